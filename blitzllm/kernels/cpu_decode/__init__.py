"""The CPU decode layer's fp32 glue around its matmuls, in C (``decode.c``): the residual add +
RMSNorm and the attention block (q / k RMSNorm, rotary, paged KV-cache write, attention over
the cache rows). ``ops.py``: the ctypes launchers beside their torch references."""
from .ops import add_rms_norm, available, decode_attention, reference_add_rms_norm, reference_decode_attention

__all__ = ["add_rms_norm", "available", "decode_attention", "reference_add_rms_norm", "reference_decode_attention"]
