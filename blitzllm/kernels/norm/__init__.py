"""RMSNorm kernels: the norm and the fused residual add + norm (``rmsnorm.py``), and the
tensor-parallel one-shot all-reduce + residual add + norm (``allreduce_rmsnorm.py``)."""
from .rmsnorm import fused_add_rms_norm, rms_norm

__all__ = ["fused_add_rms_norm", "rms_norm"]
