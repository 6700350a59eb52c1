"""RMSNorm, optionally fused with the residual add (pre-norm decoder blocks).

Dispatches through ``kernels/rmsnorm.py``: Triton on CUDA, the torch reference elsewhere.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.rmsnorm import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
