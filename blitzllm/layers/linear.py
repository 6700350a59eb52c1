"""Linear layers whose weights may be packed from several checkpoint tensors.

A ``PackedLinear`` concatenates its shards along the output dimension (q/k/v, gate/up);
the loader copies each checkpoint tensor into its slice through ``load_shard``.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from ..kernels.activation import silu_and_mul
from ..kernels.gemv import linear as gemv_linear

# BLITZ_GEMV=0 sends CUDA decode GEMMs back to cuBLAS (for A/B benchmarks)
GEMV_ENABLED = os.environ.get("BLITZ_GEMV", "1") != "0"


_WEIGHT_ONLY_MAX_ROWS = 4  # up to this many rows, weight-only layers compute in the weight dtype


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor, silu_mul_input: bool = False) -> torch.Tensor:
        """x [..., in] -> [..., out]. With ``silu_mul_input`` x is [..., 2*in] (gate, up) and
        the layer applies ``silu(gate) * up`` first, fused into the GEMV on CUDA decode."""
        w = self.weight
        if x.is_cuda and GEMV_ENABLED and x.dtype == w.dtype:
            return gemv_linear(x, w, self.bias, silu_mul_input=silu_mul_input)
        if silu_mul_input:
            x = silu_and_mul(x)
        if x.dtype != w.dtype:  # weight-only lower precision (CPU bf16 weights, fp32 activations)
            if x.numel() > _WEIGHT_ONLY_MAX_ROWS * x.shape[-1]:
                # many rows (prefill): a CPU low-precision GEMM is compute bound and slow;
                # widening the weight once costs only a read of it
                bias = None if self.bias is None else self.bias.to(x.dtype)
                return nn.functional.linear(x, w.to(x.dtype), bias)
            return nn.functional.linear(x.to(w.dtype), w, self.bias).to(x.dtype)
        return nn.functional.linear(x, w, self.bias)


def cast_linear_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """Store every Linear's weights in ``dtype`` (activations keep the model dtype). A
    tied lm_head gets its own copy, so the embedding lookup keeps full precision."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is not None and embed is not None and lm_head.weight is embed.weight:
        lm_head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
    for mod in model.modules():
        if isinstance(mod, Linear):
            mod.weight.data = mod.weight.data.to(dtype)
            if mod.bias is not None:
                mod.bias.data = mod.bias.data.to(dtype)


class PackedLinear(Linear):
    """Output dimension = sum(shard_sizes); shard i is loaded from checkpoint name i."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes), bias)
        self.shard_sizes = list(shard_sizes)

    def shard_slice(self, index: int) -> slice:
        start = sum(self.shard_sizes[:index])
        return slice(start, start + self.shard_sizes[index])
