"""DeepSeek-V3.2's lightning indexer over the paged indexer-key cache [NB, BS, 1, D]: the q/k prep
(key LayerNorm + rotary + cache write, query rotary) and the logits of query rows over their
sequence's cached keys, score(t, s) = sum_h w(t, h) * ReLU(q(t, h) . k(s)). Each op beside its
torch reference; the public ops dispatch through ``use_triton``.
"""
from __future__ import annotations

import torch


ROW_CHUNK = 64  # query rows per step of the torch references (bounds their gathered keys)


# ---- torch references (the definition) ------------------------------------------------------

def _rotate(x: torch.Tensor, cos_sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [T, heads, D] with its first P = cos_sin.shape[-1] dims rotated (fp32 math, x's dtype):
    rotate-half pairs (i, i + P/2), or interleaved pairs (2i, 2i + 1) that come out as
    [evens, odds] (the layout transformers returns; q and k both take it, so q . k holds)."""
    P = cos_sin.shape[-1]
    xf = x.float()
    r = xf[..., :P]
    if interleave:
        r = torch.cat([r[..., 0::2], r[..., 1::2]], -1)
    c, s = cos_sin[:, None, :P // 2].float(), cos_sin[:, None, P // 2:].float()
    a, b = r[..., :P // 2], r[..., P // 2:]
    return torch.cat([a * c - b * s, b * c + a * s, xf[..., P:]], -1).to(x.dtype)


def reference_indexer_qk(q, k, positions, cos_sin_cache, ln_weight, ln_bias, eps, interleave: bool = False):
    """q [T, Hi, D] (the indexer queries, wq_b's output), k [T, D] (wk's output) -> (the rotated
    queries [T, Hi, D], the keys [T, D]), in q's and k's dtypes: a key is LayerNorm(k) in fp32
    (weight and bias fp32) rounded to k's dtype, then rotated. Rotary on the first
    P = cos_sin_cache.shape[-1] dims; ``interleave``: GLM-5's pairs instead of DeepSeek-V3.2's halves."""
    D = k.shape[-1]
    cs = cos_sin_cache.index_select(0, positions.long())
    kn = torch.nn.functional.layer_norm(k.float(), (D,), ln_weight.float(), ln_bias.float(), eps).to(k.dtype)
    return _rotate(q, cs, interleave), _rotate(kn[:, None], cs, interleave)[:, 0]


def reference_indexer_prep(q, k, positions, cos_sin_cache, ln_weight, ln_bias, eps, cache, slot_mapping,
                           interleave: bool = False):
    """``reference_indexer_qk``, writing the keys into cache [NB, BS, 1, D] at ``slot_mapping``
    (negative: skipped); returns the rotated queries [T, Hi, D]."""
    q, kr = reference_indexer_qk(q, k, positions, cos_sin_cache, ln_weight, ln_bias, eps, interleave)
    keep = slot_mapping >= 0
    cache.view(-1, kr.shape[-1]).index_copy_(0, slot_mapping[keep].long(), kr[keep].to(cache.dtype))
    return q


def _row_slots(block_tables: torch.Tensor, width: int, bs: int) -> torch.Tensor:
    """[T, W] block tables -> the cache slots of positions 0..width-1 of each row, [T, width]."""
    pos = torch.arange(width, device=block_tables.device)
    return block_tables[:, pos // bs].long() * bs + pos % bs


def reference_indexer_logits(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor,
                             block_tables: torch.Tensor, lens: torch.Tensor, width: int) -> torch.Tensor:
    """q [T, Hi, D] (rotated indexer queries), weights [T, Hi] fp32 (weights_proj's output times
    Hi^-0.5 * D^-0.5), cache [NB, BS, 1, D], block_tables [T, W] int32 (each query row's own
    sequence table), lens [T] int32 (row t sees keys 0..lens[t]-1: the causal bound) ->
    logits [T, width] fp32: sum_h weights[t, h] * ReLU(q[t, h] . k[s]) for s < lens[t], -inf after."""
    T, D = q.shape[0], q.shape[-1]
    bs = cache.shape[1]
    out = torch.full((T, width), float("-inf"), dtype=torch.float32, device=q.device)
    flat = cache.view(-1, D)
    cols = torch.arange(width, device=q.device)
    for r0 in range(0, T, ROW_CHUNK):
        r1 = min(T, r0 + ROW_CHUNK)
        k = flat[_row_slots(block_tables[r0:r1], width, bs)].float()           # [t, width, D]
        s = torch.einsum("thd,tsd->ths", q[r0:r1].float(), k).relu()
        logit = torch.einsum("th,ths->ts", weights[r0:r1].float(), s)
        out[r0:r1] = logit.masked_fill(cols[None, :] >= lens[r0:r1, None].long(), float("-inf"))
    return out


# ---- public ops -------------------------------------------------------------------------------

def indexer_prep(q, k, positions, cos_sin_cache, ln_weight, ln_bias, eps, cache, slot_mapping,
                 interleave: bool = False):
    """See ``reference_indexer_prep`` (the Triton kernel is not written yet: torch everywhere)."""
    return reference_indexer_prep(q, k, positions, cos_sin_cache, ln_weight, ln_bias, eps, cache, slot_mapping,
                                  interleave)


def indexer_logits(q, weights, cache, block_tables, lens, width: int) -> torch.Tensor:
    """See ``reference_indexer_logits`` (the Triton kernel is not written yet: torch everywhere)."""
    return reference_indexer_logits(q, weights, cache, block_tables, lens, width)
