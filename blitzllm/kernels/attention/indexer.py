"""DeepSeek-V3.2's lightning indexer over the paged indexer-key cache [NB, BS, 1, D]: the q/k prep
(key LayerNorm + rotary + cache write, query rotary) and the logits of query rows over their
sequence's cached keys, score(t, s) = sum_h w(t, h) * ReLU(q(t, h) . k(s)). Each op beside its
torch reference; the public ops dispatch through ``use_triton``.
"""
from __future__ import annotations

import torch

from .._common import device_sms, next_pow2, tl, triton, unit_stride, use_triton
from .mla_prep import _rotate as _rope_rows

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


# ---- Triton -----------------------------------------------------------------------------------

@triton.jit
def _indexer_prep_kernel(
    q_ptr, k_ptr, pos_ptr, cs_ptr, lw_ptr, lb_ptr, slot_ptr, cache_ptr, qo_ptr,
    stride_qt, stride_qh, stride_kt, stride_cs, stride_slot, stride_qot, H, eps,
    D: tl.constexpr, D_PAD: tl.constexpr, P: tl.constexpr, HALF_PAD: tl.constexpr, HB: tl.constexpr,
    INTERLEAVE: tl.constexpr,
):
    """Program (t, 0): the key of token t, LayerNorm (fp32, rounded to k's dtype) + rotary, into
    the cache at its slot; programs (t, 1 + j): rotary of query heads j*HB.. of token t."""
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    HALF: tl.constexpr = P // 2
    offs_d = tl.arange(0, D_PAD)
    offs_p = tl.arange(0, HALF_PAD)
    pmask = offs_p < HALF
    cs = cs_ptr + tl.load(pos_ptr + t) * stride_cs
    if part == 0:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:  # normalised key into the cache, then its rope dims rotated in place
            dmask = offs_d < D
            x = tl.load(k_ptr + t * stride_kt + offs_d, mask=dmask, other=0.0)
            xf = x.to(tl.float32)
            diff = tl.where(dmask, xf - tl.sum(xf, axis=0) / D, 0.0)
            rstd = tl.rsqrt(tl.sum(diff * diff, axis=0) / D + eps)
            w = tl.load(lw_ptr + offs_d, mask=dmask, other=0.0)
            b = tl.load(lb_ptr + offs_d, mask=dmask, other=0.0)
            dst = cache_ptr + slot * stride_slot
            tl.store(dst + offs_d, (diff * rstd * w + b).to(x.dtype).to(cache_ptr.dtype.element_ty), mask=dmask)
            tl.debug_barrier()
            first, second = _rope_rows(dst, cs, offs_p, pmask, HALF, INTERLEAVE)
            tl.debug_barrier()  # (interleaved pairs: every read before the halves are overwritten)
            tl.store(dst + offs_p, first.to(x.dtype).to(cache_ptr.dtype.element_ty), mask=pmask)
            tl.store(dst + HALF + offs_p, second.to(x.dtype).to(cache_ptr.dtype.element_ty), mask=pmask)
    else:
        offs_h = (part - 1) * HB + tl.arange(0, HB)
        hmask = offs_h < H
        src = q_ptr + t * stride_qt + offs_h[:, None].to(tl.int64) * stride_qh
        dst = qo_ptr + t * stride_qot + offs_h[:, None] * D
        first, second = _rope_rows(src, cs, offs_p[None, :], hmask[:, None] & pmask[None, :], HALF, INTERLEAVE)
        m = hmask[:, None] & pmask[None, :]
        tl.store(dst + offs_p[None, :], first.to(qo_ptr.dtype.element_ty), mask=m)
        tl.store(dst + HALF + offs_p[None, :], second.to(qo_ptr.dtype.element_ty), mask=m)
        rest = hmask[:, None] & (offs_d[None, :] >= P) & (offs_d[None, :] < D)
        tl.store(dst + offs_d[None, :], tl.load(src + offs_d[None, :], mask=rest, other=0.0), mask=rest)


PREP_HEADS_PER_PROG = 16


def indexer_prep_triton(q, k, positions, cos_sin_cache, ln_weight, ln_bias, eps, cache, slot_mapping,
                        interleave: bool = False):
    """Same contract as reference_indexer_prep (q, k: rows may be strided views with unit stride
    inside a head); returns a new contiguous [T, Hi, D]."""
    T, H, D = q.shape
    P = cos_sin_cache.shape[-1]
    assert q.stride(2) == 1 and k.stride(1) == 1 and k.shape[1] == D and cache.shape[-1] == D
    assert P % 2 == 0 and P <= D and cos_sin_cache.stride(-1) == 1 and cache.stride(-1) == 1
    assert cache.stride(0) == cache.shape[1] * cache.stride(1), "cache blocks must be contiguous"
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    _indexer_prep_kernel[(T, 1 + triton.cdiv(H, PREP_HEADS_PER_PROG))](
        q, k, positions, cos_sin_cache, ln_weight, ln_bias, slot_mapping, cache, out,
        q.stride(0), q.stride(1), k.stride(0), cos_sin_cache.stride(0), cache.stride(1), out.stride(0), H, float(eps),
        D=D, D_PAD=next_pow2(D), P=P, HALF_PAD=next_pow2(P // 2), HB=PREP_HEADS_PER_PROG,
        INTERLEAVE=bool(interleave), num_warps=4,
    )
    return out


@triton.jit
def _indexer_logits_kernel(
    q_ptr, w_ptr, cache_ptr, bt_ptr, lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_wt, stride_cb, stride_ct, stride_bt, stride_ot, H,
    D: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr,
):
    """Program (t, s): row t's key tiles s, s + S, s + 2S, ... below lens[t]; all heads of the row
    at once (one [heads, D] x [D, BLOCK_N] product), ReLU, weighted head sum."""
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    n = tl.load(lens_ptr + t)
    if split * BLOCK_N >= n:
        return
    heads = tl.arange(0, H_PAD)
    hmask = heads < H
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < D
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    w = tl.load(w_ptr + t * stride_wt + heads, mask=hmask, other=0.0)
    bt = bt_ptr + t * stride_bt
    for s0 in range(split * BLOCK_N, n, tl.num_programs(1) * BLOCK_N):
        offs_n = s0 + tl.arange(0, BLOCK_N)
        valid = offs_n < n
        blk = tl.load(bt + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        k = tl.load(cache_ptr + blk[:, None] * stride_cb + (offs_n % BLOCK_SIZE)[:, None] * stride_ct
                    + offs_d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        logit = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
        tl.store(out_ptr + t * stride_ot + offs_n, logit, mask=valid)


LOGITS_BLOCK_N = 64


def indexer_logits_triton(q, weights, cache, block_tables, lens, width: int, splits: int = 0) -> torch.Tensor:
    """Same contract as reference_indexer_logits, except that entries at or past lens[t] are left
    unwritten. ``splits``: programs per row (default: about four per SM over all rows, at most a
    key tile each)."""
    T, H, D = q.shape
    out = torch.empty((T, width), dtype=torch.float32, device=q.device)
    if T == 0:
        return out
    assert cache.shape[-1] == D and cache.stride(-1) == 1 and weights.dtype == torch.float32
    q = unit_stride(q.to(cache.dtype))
    tiles = triton.cdiv(max(1, width), LOGITS_BLOCK_N)
    splits = splits or max(1, min(tiles, 4 * device_sms(q) // T))
    _indexer_logits_kernel[(T, splits)](
        q, weights, cache, block_tables, lens, out,
        q.stride(0), q.stride(1), weights.stride(0), cache.stride(0), cache.stride(1), block_tables.stride(0),
        out.stride(0), H,
        D=D, H_PAD=max(16, next_pow2(H)), D_PAD=max(16, next_pow2(D)), BLOCK_N=LOGITS_BLOCK_N,
        BLOCK_SIZE=cache.shape[1], IEEE=cache.dtype == torch.float32, num_warps=4,
    )
    return out


# ---- public ops -------------------------------------------------------------------------------

def indexer_prep(q, k, positions, cos_sin_cache, ln_weight, ln_bias, eps, cache, slot_mapping,
                 interleave: bool = False):
    """See ``reference_indexer_prep``; one Triton launch on CUDA (no host sync)."""
    fn = indexer_prep_triton if use_triton(q) else reference_indexer_prep
    return fn(q, k, positions, cos_sin_cache, ln_weight, ln_bias, eps, cache, slot_mapping, interleave)


def indexer_logits(q, weights, cache, block_tables, lens, width: int) -> torch.Tensor:
    """See ``reference_indexer_logits``; the Triton kernel on CUDA (fixed grid, no host sync), which
    leaves the entries at or past ``lens[t]`` unwritten."""
    fn = indexer_logits_triton if use_triton(q) else reference_indexer_logits
    return fn(q, weights, cache, block_tables, lens, width)
