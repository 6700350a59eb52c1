"""Decode GEMMs of a few rows (``y = x @ W^T``), bound by reading W: the Triton GEMV
(``gemv.py``: FMA at 1-2 rows, tensor cores from 3, split-K reduced in the same launch, the
SiLU-and-mul fused into the input or, for gate_up, the epilogue) and, on Hopper, the TMA GEMV
(``gemv_tma.py``, Gluon: the weights stream by bulk copies before the PDL wait). Entry points:
``linear`` (the layers' dispatch), ``glu_linear``; references ``reference_linear``."""
from .gemv import GEMV_MAX_ROWS, glu_linear, glu_ok, linear, reference_linear

__all__ = ["GEMV_MAX_ROWS", "glu_linear", "glu_ok", "linear", "reference_linear"]
