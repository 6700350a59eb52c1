"""Linear layers whose weights may be packed from several checkpoint tensors.

A ``PackedLinear`` concatenates its shards along the output dimension (q/k/v, gate/up);
the loader copies each checkpoint tensor into its slice through ``load_shard``.
"""
from __future__ import annotations

import torch
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class PackedLinear(Linear):
    """Output dimension = sum(shard_sizes); shard i is loaded from checkpoint name i."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes), bias)
        self.shard_sizes = list(shard_sizes)

    def shard_slice(self, index: int) -> slice:
        start = sum(self.shard_sizes[:index])
        return slice(start, start + self.shard_sizes[index])
