"""SiLU-and-mul over a packed [gate | up] projection output (Triton on CUDA)."""
from ..kernels.activation import silu_and_mul  # noqa: F401
