"""The CPU decode layer's glue around its matmuls, in C (``decode.c``): the residual add +
RMSNorm and the attention block (q / k RMSNorm, rotary, paged KV-cache write, attention over
the cache rows) in fp32 and in bf16 (the glue around torch's bf16 GEMMs), a whole fp32 step in
one call, token ids to logits (``DecodeLayers``), a one-row bf16 step's layers
(``DecodeLayersBf16``), and greedy sampling's argmax + log-softmax in one call (``greedy``); the
caches of the activations' dtype or fp8 (e4m3: ``to_e4m3``, the C forms' rounding).
``ops.py``: the ctypes launchers beside their torch references."""
from .ops import (DecodeLayers, DecodeLayersBf16, add_rms_norm, available, decode_attention, greedy,
                  reference_add_rms_norm, reference_decode_attention, to_e4m3)

__all__ = ["DecodeLayers", "DecodeLayersBf16", "add_rms_norm", "available", "decode_attention", "greedy",
           "reference_add_rms_norm", "reference_decode_attention", "to_e4m3"]
