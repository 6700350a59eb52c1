"""Linear layers whose weights may be packed from several checkpoint tensors.

A ``PackedLinear`` concatenates its shards along the output dimension (q/k/v, gate/up);
the loader copies each checkpoint tensor into its slice through ``load_shard``.
"""
from __future__ import annotations

import torch
from torch import nn


_WEIGHT_ONLY_MAX_ROWS = 4  # up to this many rows, weight-only layers compute in the weight dtype


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
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
