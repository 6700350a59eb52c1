"""Weight-only quantized matmuls on the CPU that keep a GGUF checkpoint's grid: 4-bit groups
(Q4_0 / Q4_1) through torch's int4 CPU kernel with fp32 scales and zeros (the dequantized
values exactly), 8-bit blocks (Q8_0) as two 4-bit halves through the same kernel, and int8 per
output channel. ``pack.py`` holds the packing and the plain-torch ``reference_*``."""
from .pack import (QuantWeight, int4_matmul, pack_q4, pack_q8_blocks, reference_dequantize,
                   reference_matmul)

__all__ = ["QuantWeight", "int4_matmul", "pack_q4", "pack_q8_blocks", "reference_dequantize",
           "reference_matmul"]
