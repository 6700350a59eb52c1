"""Top-k selection over rows of indexer logits (DeepSeek-V3.2's sparse attention): per row, the
``k`` highest of its first ``lens[t]`` entries, as int32 positions in ascending order with -1
padding. Ties go to the lower position, so a selection never depends on the row's width or the
method.
"""
from __future__ import annotations

import torch



def reference_topk(logits: torch.Tensor, lens: torch.Tensor, k: int) -> torch.Tensor:
    """logits [T, N] fp32 (finite where valid), lens [T] int32 (<= N) -> [T, k] int32: the
    positions of the min(k, lens[t]) largest logits[t, :lens[t]] (equal values: the lower
    position first), ascending, then -1."""
    T, N = logits.shape
    cols = torch.arange(N, device=logits.device)
    valid = cols[None, :] < lens[:, None].long()
    x = logits.float().masked_fill(~valid, float("-inf"))
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]   # ties: lower first
    if order.shape[1] < k:
        order = torch.cat([order, order.new_full((T, k - order.shape[1]), N)], 1)
    rank = torch.arange(k, device=logits.device)
    chosen = torch.where(rank[None, :] < lens[:, None].long(), order, N)          # N: a padding slot
    chosen = torch.sort(chosen, dim=-1).values
    return torch.where(chosen < N, chosen, -1).to(torch.int32)


def topk(logits: torch.Tensor, lens: torch.Tensor, k: int) -> torch.Tensor:
    """See ``reference_topk`` (the Triton kernel is not written yet: torch everywhere)."""
    return reference_topk(logits, lens, k)
