"""RMSNorm, optionally fused with the residual add (pre-norm decoder blocks), through
``kernels/norm/rmsnorm.py``. Built for more than one tensor-parallel rank, the norm first sums
its input (the row-parallel partial sums before it) over the ranks
(``distributed/allreduce_norm.py``).
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.norm.rmsnorm import fused_add_rms_norm, rms_norm


class Fp32Params(nn.Module):
    """A module whose own parameters stay float32 through a model-wide cast (``model.to(bf16)``)."""

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for p in self.parameters(recurse=False):
            if p.dtype != torch.float32:
                p.data = p.data.float()
        return self


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
        if x.device.type == "cpu" and x.dtype == residual.dtype == self.weight.dtype == torch.bfloat16:
            # our C form (kernels/cpu_decode): the reference's bf16 roundings, one pass, where a
            # CPU's torch ops take eight passes over the rows
            from ..kernels import cpu_decode
            if cpu_decode.available():
                H = x.shape[-1]
                res = residual.reshape(-1, H).contiguous()
                new = torch.empty_like(res)
                h = cpu_decode.add_rms_norm(x.reshape(-1, H).contiguous(), res, self.weight, self.eps, res_out=new)
                return h.view(x.shape), new.view(x.shape)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class OffsetRMSNorm(Fp32Params, RMSNorm):
    """RMSNorm scaling by (1 + w) (Qwen3-Next, Qwen3.5): ``weight`` holds 1 + the checkpoint's w in
    fp32 (``load_checkpoint`` adds the 1; a model-wide cast leaves it fp32), so every RMSNorm kernel
    takes it and 1 + w is exact. Below fp32 the normalized x is rounded before the multiply
    (transformers rounds once)."""

    def load_checkpoint(self, sub: str, tensor, name: str):
        """Checkpoint tensor ``name`` (``sub`` relative to this norm) -> weight = 1 + it."""
        if sub != "weight":
            return None
        from .parallel import check_shape, read_full
        check_shape(tensor, self.weight.shape, name)
        with torch.no_grad():
            self.weight.copy_(read_full(tensor).float() + 1.0)
        return [name]
