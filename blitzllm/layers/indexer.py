"""DeepSeek-V3.2's lightning indexer: per query token, the ``topk`` earlier tokens whose score
sum_h w(t, h) * ReLU(q(t, h) . k(s)) is highest. Its queries and keys come out of the attention's
packed GEMMs (``layers/sparse_mla.py``); this module holds the rest (the key LayerNorm, the head
weights) and runs the prep, logits and selection ops of ``kernels/attention``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.attention.indexer import indexer_logits, indexer_prep, reference_indexer_qk
from ..kernels.attention.topk import topk
from .norm import Fp32Params

_KEY_NORM_EPS = 1e-6  # the key LayerNorm: transformers and DeepSeek build it with this eps


@dataclass(frozen=True)
class IndexerDims:
    n_heads: int      # index_n_heads
    head_dim: int     # index_head_dim (values per token in the key cache)
    topk: int         # index_topk
    rope_dim: int     # the first rope_dim dims of q and k are rotated (qk_rope_head_dim)
    interleave: bool = False  # rotary pairs: False, DeepSeek-V3.2's halves; True, GLM-5's interleaved pairs

    @property
    def weight_scale(self) -> float:
        """The head weights' factor: index_n_heads^-0.5 times the softmax scale index_head_dim^-0.5."""
        return self.n_heads ** -0.5 * self.head_dim ** -0.5


class KeyNorm(Fp32Params):
    """The key LayerNorm (weight and bias, fp32), checkpoint ``indexer.k_norm``."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = _KEY_NORM_EPS


class HeadWeights(Fp32Params):
    """``indexer.weights_proj`` [index_n_heads, hidden] in fp32, as transformers keeps it."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, hidden))


class Indexer(nn.Module):
    """Checkpoint names ``self_attn.indexer.{k_norm, weights_proj}``; its ``wq_b`` and ``wk`` are
    shards of the attention's packed GEMMs. Replicated over tensor-parallel ranks: every rank
    selects the same tokens."""

    def __init__(self, dims: IndexerDims, hidden: int):
        super().__init__()
        self.dims = dims
        self.k_norm = KeyNorm(dims.head_dim)
        self.weights_proj = HeadWeights(hidden, dims.n_heads)

    def head_weights(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] (the layer's normed input) -> w [T, index_n_heads] fp32, scales folded in."""
        return nn.functional.linear(h.float(), self.weights_proj.weight) * self.dims.weight_scale

    def qk(self, q, k, positions, cos_sin_cache) -> tuple:
        """(rotated queries [T, Hi, D], keys [T, D]) in torch, without a cache (the MTP draft)."""
        n = self.k_norm
        return reference_indexer_qk(q, k, positions, cos_sin_cache, n.weight, n.bias, n.eps, self.dims.interleave)

    def prep(self, q, k, positions, cos_sin_cache, cache, slot_mapping) -> torch.Tensor:
        """Write this step's keys into the indexer cache; returns the rotated queries [T, Hi, D]."""
        n = self.k_norm
        return indexer_prep(q, k, positions, cos_sin_cache, n.weight, n.bias, n.eps, cache, slot_mapping,
                            self.dims.interleave)

    def select(self, q, h, cache, block_tables, lens) -> torch.Tensor:
        """Rows' rotated queries q [T, Hi, D] and layer inputs h [T, hidden], each row over keys
        0..lens[t]-1 of its table block_tables[t] -> [T, topk] int32 positions (ascending, -1 padded)."""
        logits = indexer_logits(q, self.head_weights(h), cache, block_tables, lens,
                                block_tables.shape[1] * cache.shape[1])
        return topk(logits, lens, self.dims.topk)
