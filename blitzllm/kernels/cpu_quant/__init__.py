"""Weight-only quantized matmuls on the CPU that keep a GGUF checkpoint's blocks (Q4_0, Q4_1,
Q8_0): our AVX-512 fp32 kernels (``native.py``, ``qgemm.c``) or, where they do not build, torch's
int4 CPU kernel. ``pack.py`` holds the weight form, the dispatch and the plain-torch
``reference_*``."""
from .pack import QuantWeight, pack_q4, pack_q8_blocks, quant_matmul, reference_dequantize

__all__ = ["QuantWeight", "pack_q4", "pack_q8_blocks", "quant_matmul", "reference_dequantize"]
