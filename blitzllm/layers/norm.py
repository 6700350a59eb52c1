"""RMSNorm, optionally fused with the residual add (pre-norm decoder blocks).

Dispatches through ``kernels/rmsnorm.py``: Triton on CUDA, the torch reference elsewhere.
Built with a tensor-parallel group of more than one rank, the norm first sums its input
over the ranks (``distributed/allreduce_norm.py``): the pre-norms of a decoder receive
partial sums from the row-parallel projections before them.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.rmsnorm import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6, tp=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.tp = tp if tp is not None and tp.world_size > 1 else None  # all-reduces its input

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual).
        Reducing over ranks (``tp``): always the pair, x summed over the ranks first."""
        if self.tp is not None:
            from ..distributed.allreduce_norm import all_reduce_add_rms_norm
            return all_reduce_add_rms_norm(x, residual, self.weight, self.eps, self.tp)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
