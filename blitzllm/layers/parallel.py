"""Tensor-parallel layers: the builders models call instead of constructing ``Linear`` /
``PackedLinear`` / embeddings directly, and the ``tp_parts`` each sharded module declares
(which part of each checkpoint tensor a rank holds). With one rank the builders return the
plain layers. Knows nothing about processes (docs/tensor-parallel.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from .linear import Linear, PackedLinear
from ..distributed.parallel_state import TPGroup


@dataclass(frozen=True)
class Part:
    """This rank holds ``checkpoint.narrow(dim, start, size)`` of a tensor of ``full`` entries along
    ``dim`` (zeros past ``full``: the last rank's padded vocabulary); ``zero``: the rank holds
    zeros (a row-parallel bias, added by rank 0 only)."""
    dim: int
    start: int
    size: int
    full: int
    zero: bool = False


def shape_of(t) -> tuple:
    """Shape of a tensor or of a lazy safetensors slice."""
    return tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t.get_shape())


def check_shape(t, expect: Sequence[int], name: str) -> None:
    """Raise ValueError unless checkpoint tensor ``name`` (``t``) has the shape ``expect``."""
    if shape_of(t) != tuple(expect):
        raise ValueError(f"shape mismatch for {name}: checkpoint {shape_of(t)}, model {tuple(expect)}")


def read_full(t) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t[:]


def read_block(t, index: Sequence[slice]) -> torch.Tensor:
    """``t[index]``: a view of a tensor, or only those bytes of a lazy safetensors slice."""
    return t[tuple(index)]


def copy_part(dst: torch.Tensor, src, part: Optional[Part], name: str) -> None:
    """Copy this rank's ``part`` of checkpoint tensor ``src`` into ``dst`` (all of it when
    ``part`` is None), checking the checkpoint's full shape."""
    expect = list(dst.shape)
    if part is not None:
        expect[part.dim] = part.full
    check_shape(src, expect, name)
    with torch.no_grad():
        if part is None:
            dst.copy_(read_full(src))
            return
        if part.zero:
            dst.zero_()
            return
        n = max(0, min(part.size, part.full - part.start))
        index = [slice(None)] * dst.dim()
        index[part.dim] = slice(part.start, part.start + n)
        dst.narrow(part.dim, 0, n).copy_(read_block(src, index))
        if n < dst.shape[part.dim]:
            dst.narrow(part.dim, n, dst.shape[part.dim] - n).zero_()


def module_part(module: nn.Module, leaf: str, shard: Optional[int]) -> Optional[Part]:
    parts = getattr(module, "tp_parts", None)
    return parts.get((leaf, shard)) if parts else None


def even_part(full: int, tp: TPGroup, what: str, dim: int = 0) -> Part:
    start, size = tp.split(full, what)
    return Part(dim, start, size, full)


# ---- builders -----------------------------------------------------------------------------

def column_linear(in_features: int, out_features: int, tp: TPGroup, bias: bool = False,
                  what: str = "output size") -> Linear:
    """Output rows split evenly over the ranks."""
    if tp.world_size == 1:
        return Linear(in_features, out_features, bias)
    part = even_part(out_features, tp, what)
    mod = Linear(in_features, part.size, bias)
    mod.tp_parts = {("weight", None): part, ("bias", None): part}
    return mod


def packed_column_linear(in_features: int, sizes: Sequence[int], tp: TPGroup, bias: bool = False,
                         parts: Optional[Sequence[Optional[Part]]] = None, what: str = "output size") -> PackedLinear:
    """A ``PackedLinear`` of checkpoint tensors with ``sizes`` output rows each: each split
    evenly over the ranks, or as ``parts[i]`` says (None: replicated on every rank)."""
    if tp.world_size == 1:
        return PackedLinear(in_features, list(sizes), bias)
    if parts is None:
        parts = [even_part(s, tp, what) for s in sizes]
    local = [p.size if p is not None else s for p, s in zip(parts, sizes)]
    mod = PackedLinear(in_features, local, bias)
    mod.tp_parts = {(leaf, i): p for i, p in enumerate(parts) if p is not None for leaf in ("weight", "bias")}
    return mod


def row_linear(in_features: int, out_features: int, tp: TPGroup, bias: bool = False,
               what: str = "input size", part: Optional[Part] = None) -> Linear:
    """Input columns split over the ranks (evenly, or ``part`` along dim 1); the output is
    this rank's partial sum. The bias is rank 0's alone, so the sum adds it once."""
    if tp.world_size == 1:
        return Linear(in_features, out_features, bias)
    part = part or even_part(in_features, tp, what, dim=1)
    mod = Linear(part.size, out_features, bias)
    mod.tp_parts = {("weight", None): part,
                    ("bias", None): Part(0, 0, out_features, out_features, zero=tp.rank != 0)}
    return mod


def shard_rows(module: nn.Module, part: Optional[Part], leaf: str = "weight") -> nn.Module:
    """Declare that ``module.<leaf>`` holds ``part`` of its checkpoint tensor."""
    if part is not None:
        module.tp_parts = {**getattr(module, "tp_parts", {}), (leaf, None): part}
    return module


def vocab_part(vocab: int, tp: TPGroup) -> Part:
    per = -(-vocab // tp.world_size)
    return Part(0, tp.rank * per, per, vocab)


class VocabParallelEmbedding(nn.Module):
    """Rows ``[rank * per, (rank + 1) * per)`` of the embedding (zeros past the vocabulary); other
    ranks' tokens embed to zeros, so the output is a partial sum the first norm all-reduces."""

    def __init__(self, vocab: int, hidden: int, tp: TPGroup):
        super().__init__()
        part = vocab_part(vocab, tp)
        self.start, self.end = part.start, min(vocab, part.start + part.size)
        self.weight = nn.Parameter(torch.empty(part.size, hidden))
        self.tp_parts = {("weight", None): part}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.end - self.start)
        out = nn.functional.embedding(torch.where(mine, local, 0), self.weight)
        return out.masked_fill(~mine[:, None], 0.0)


class ParallelLMHead(Linear):
    """Vocabulary rows split like ``VocabParallelEmbedding`` (and tied to it when the model
    ties them); each rank's logits are all-gathered, so rank 0 samples from all of them."""

    def __init__(self, hidden: int, vocab: int, tp: TPGroup):
        part = vocab_part(vocab, tp)
        super().__init__(hidden, part.size)
        self.vocab, self.tp = vocab, tp
        self.tp_parts = {("weight", None): part}

    def forward(self, x: torch.Tensor, silu_mul_input: bool = False) -> torch.Tensor:
        local = super().forward(x, silu_mul_input)
        n, per, world = local.shape[0], local.shape[1], self.tp.world_size
        full = self.tp.all_gather_rows(local).view(world, n, per).transpose(0, 1)
        return full.reshape(n, world * per)[:, :self.vocab]


def vocab_embedding(vocab: int, hidden: int, tp: TPGroup) -> nn.Module:
    if tp.world_size > 1:
        return VocabParallelEmbedding(vocab, hidden, tp)
    if torch.get_default_device().type == "meta":
        # the loader fills it; a meta normal_ would import torch._dynamo (a second of start-up)
        return nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden))
    return nn.Embedding(vocab, hidden)


def lm_head(hidden: int, vocab: int, tp: TPGroup) -> Linear:
    return Linear(hidden, vocab) if tp.world_size == 1 else ParallelLMHead(hidden, vocab, tp)
