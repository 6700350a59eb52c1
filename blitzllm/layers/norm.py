"""RMSNorm, optionally fused with the residual add (pre-norm decoder blocks).

The CPU path is plain torch; on CUDA the Triton kernels in ``kernels/rmsnorm.py`` are used
once they are wired in through ``blitzllm.kernels`` dispatch.
"""
from __future__ import annotations

import torch
from torch import nn


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return rms_norm_torch(x, self.weight, self.eps)
        x = x + residual
        return rms_norm_torch(x, self.weight, self.eps), x
