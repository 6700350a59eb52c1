"""Attention over the paged KV cache: split-K decode and varlen causal prefill.

Both kernels handle GQA by packing the G = Hq // Hkv query heads that share a
kv head into the rows of one tile, so every K/V tile is read once per kv head.
Scores and softmax statistics are fp32 (exp2 with the scale folded in); the
probabilities are cast to the cache dtype for the P @ V product, as flash
attention does. Neither launcher syncs with the host, so both can be captured
in a CUDA graph (the decode grid depends only on B, Hkv and the SM count).
"""
import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ._common import (L2_PREFETCH_LANES, device_sms, l2_prefetch, l2_prefetch_chunk, l2_prefetch_supported,
                      next_pow2, pdl_enabled, pdl_launch_dependents, pdl_launch_kwargs, pdl_wait, tl, triton,
                      use_triton)
from .qk_norm_rope_cache import _check as _check_qk
from .qk_norm_rope_cache import _norm_rope_apply, _norm_rope_params

_LOG2E = 1.4426950408889634
_NEG = -1.0e30  # finite "minus infinity" for running maxima: avoids inf - inf


@triton.jit
def _attn_scores(m_i, l_i, q, k, keep, qk_scale, IEEE: tl.constexpr):
    """Online-softmax statistics of one key tile: returns (p, alpha, m_new, l_new)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(keep, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _attn_pv(acc, alpha, p, v, IEEE: tl.constexpr):
    if IEEE:
        return acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _kv_tile_offsets(bt_ptr, offs_n, valid, stride_b, stride_t, offs_d, BLOCK_SIZE: tl.constexpr):
    """Cache offsets [BLOCK_N, D_PAD] of keys offs_n (through the block table)."""
    blk = tl.load(bt_ptr + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return (blk * stride_b + (offs_n % BLOCK_SIZE) * stride_t)[:, None] + offs_d[None, :]


@triton.jit
def _attn_tile(
    acc, m_i, l_i, q, k_ptr, v_ptr, bt_ptr, start_n, kv_end, q_pos, qk_scale,
    stride_kb, stride_kt, stride_vb, stride_vt, offs_d, dmask,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, EARLY_V: tl.constexpr,
):
    """One online-softmax step over keys [start_n, start_n + BLOCK_N) (< kv_end).
    qk_scale is scale * log2(e); q_pos [M] are the rows' positions (if CAUSAL)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    valid = offs_n < kv_end
    blk = tl.load(bt_ptr + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    tok = offs_n % BLOCK_SIZE
    kmask = valid[:, None] & dmask[None, :]
    k = tl.load(k_ptr + (blk * stride_kb + tok * stride_kt)[:, None] + offs_d[None, :],
                mask=kmask, other=0.0)
    v_off = (blk * stride_vb + tok * stride_vt)[:, None] + offs_d[None, :]
    if EARLY_V:  # issue the V load before the softmax: shorter latency chain (decode)
        v = tl.load(v_ptr + v_off, mask=kmask, other=0.0)
    keep = valid[None, :]
    if CAUSAL:
        keep = keep & (offs_n[None, :] <= q_pos[:, None])
    p, alpha, m_new, l_i = _attn_scores(m_i, l_i, q, k, keep, qk_scale, IEEE)
    if not EARLY_V:
        v = tl.load(v_ptr + v_off, mask=kmask, other=0.0)
    return _attn_pv(acc, alpha, p, v, IEEE), m_new, l_i


@triton.jit
def _combine_splits(m_ptr, l_ptr, acc_ptr, out_ptr, b, head0, G, n_active, base, stride_ob, stride_oh,
                    NUM_SPLITS: tl.constexpr, G_COMB: tl.constexpr, COMBINE: tl.constexpr,
                    D: tl.constexpr, D_PAD: tl.constexpr):
    """Merge the first n_active split partials of query heads [head0, head0 + G) (rows
    base + g * NUM_SPLITS + split) and write the output: COMBINE splits per round, their
    loads issued together ([G_COMB, COMBINE, D_PAD] tiles from L2)."""
    offs_g = tl.arange(0, G_COMB)
    offs_s = tl.arange(0, COMBINE)
    offs_d = tl.arange(0, D_PAD)
    gmask = offs_g < G
    m_all = tl.full([G_COMB], -1.0e30, dtype=tl.float32)
    l_all = tl.zeros([G_COMB], dtype=tl.float32)
    o_all = tl.zeros([G_COMB, D_PAD], dtype=tl.float32)
    for s0 in range(0, n_active, COMBINE):
        rows = base + offs_g[:, None] * NUM_SPLITS + s0 + offs_s[None, :]   # [G_COMB, COMBINE]
        ok = gmask[:, None] & ((s0 + offs_s) < n_active)[None, :]
        m_s = tl.load(m_ptr + rows, mask=ok, other=-1.0e30, cache_modifier=".cg")
        l_s = tl.load(l_ptr + rows, mask=ok, other=0.0, cache_modifier=".cg")
        a_s = tl.load(acc_ptr + rows[:, :, None] * D_PAD + offs_d[None, None, :],
                      mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_all, tl.max(m_s, axis=1))
        w_old = tl.exp2(m_all - m_new)
        w_s = tl.exp2(m_s - m_new[:, None])
        l_all = l_all * w_old + tl.sum(l_s * w_s, axis=1)
        o_all = o_all * w_old[:, None] + tl.sum(a_s * w_s[:, :, None], axis=1)
        m_all = m_new
    out = o_all / tl.where(l_all > 0.0, l_all, 1.0)[:, None]
    heads = head0 + offs_g
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & (offs_d < D)[None, :])


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    qk_scale, G,
    NUM_SPLITS: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr,
    EARLY_V: tl.constexpr, FUSED_REDUCE: tl.constexpr, USE_PDL: tl.constexpr,
    G_COMB: tl.constexpr, COMBINE: tl.constexpr,
    pos_ptr, cs_ptr, stride_cs, qw_ptr, kw_ptr, slot_ptr, Hq, eps,
    FUSE_QK: tl.constexpr, HAS_NORM: tl.constexpr, ROT: tl.constexpr, EARLY_QK: tl.constexpr,
    IDLE_EXIT: tl.constexpr,
    pf0, pn0, pf1, pn1, pf2, pn2, pf3, pn3, pf_chunk, NPF: tl.constexpr, PF_LANES: tl.constexpr,
    EARLY_DEPS: tl.constexpr = False, PARTIALS: tl.constexpr = False, zero_ptr=None, zero_n=0,
    ZERO_BLOCK: tl.constexpr = 0,
):
    """PARTIALS (FUSED_REDUCE off): the splits store their partials and nothing merges them;
    the consumer does (``DecodePartials``); idle splits exit at once as with the fused merge.
    ZERO_BLOCK > 0: each sequence's split-0 programs also zero ZERO_BLOCK fp32 values of
    zero_ptr's zero_n (after the wait: the buffer's last reader ran before the kernel before),
    the output an atomic consumer adds into."""
    if EARLY_DEPS:  # the next kernel (the TMA GEMV, streaming its weights meanwhile) launches now
        pdl_launch_dependents(USE_PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if NPF > 0:  # the next GEMVs' weights into L2 while this latency-bound kernel runs
        pid = (b * tl.num_programs(1) + kvh) * tl.num_programs(2) + split
        nprog = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        l2_prefetch(pf0, pn0, pf_chunk, pid, nprog, PF_LANES)
        if NPF > 1:
            l2_prefetch(pf1, pn1, pf_chunk, pid, nprog, PF_LANES)
        if NPF > 2:
            l2_prefetch(pf2, pn2, pf_chunk, pid, nprog, PF_LANES)
        if NPF > 3:
            l2_prefetch(pf3, pn3, pf_chunk, pid, nprog, PF_LANES)
    if not FUSE_QK:
        pdl_wait(USE_PDL)  # q and this step's k/v come from the kernel before
    seq_len = tl.load(seq_lens_ptr + b)
    # Each split takes a run of BLOCK_N tiles of this sequence's context, as few as spread
    # the context over the splits (one tile each for a short context); idle splits exit at
    # once. The combine reads COMBINE splits per round, so it costs only a few L2 round
    # trips. (plain arithmetic: tl.cdiv is itself a jit function)
    n_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
    per = tl.maximum((n_tiles + NUM_SPLITS - 1) // NUM_SPLITS, 1)
    n_active = tl.maximum((n_tiles + per - 1) // per, 1)  # split 0 also for an empty row
    chunk = per * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    # with the fused combine, idle splits do nothing (IDLE_EXIT; else they join the count)
    if (split < n_active) | (not (FUSED_REDUCE or PARTIALS)) | (not IDLE_EXIT):
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D_PAD)
        dmask = offs_d < D
        heads = kvh * G + offs_g
        gmask = offs_g < G
        qmask = gmask[:, None] & dmask[None, :]
        bt = bt_ptr + b.to(tl.int64) * stride_bt
        if FUSE_QK:
            # q_ptr is the qkv projection output [B, (Hq + 2 Hkv) * D]: this program norms and
            # rotates its G query heads itself, and the split holding the new position writes
            # that token's k (normed, rotated) and v into the cache.
            # The split's first K/V tile, less the new position, is already in the cache (block
            # table, lengths and older keys were written before the kernel before): it loads
            # before waiting on that kernel (PDL); the new key and value are put into it below.
            offs_n0 = start + tl.arange(0, BLOCK_N)
            old0 = offs_n0 < tl.minimum(end, seq_len - 1)
            m0 = old0[:, None] & dmask[None, :]
            k0 = tl.load(k_ptr + kvh * stride_kh + _kv_tile_offsets(bt, offs_n0, old0, stride_kb, stride_kt, offs_d,
                                                                     BLOCK_SIZE), mask=m0, other=0.0)
            v0 = tl.load(v_ptr + kvh * stride_vh + _kv_tile_offsets(bt, offs_n0, old0, stride_vb, stride_vt, offs_d,
                                                                     BLOCK_SIZE), mask=m0, other=0.0)
            # positions, cos/sin, the norm weights and the slot do not come from the kernel
            # before either (host copies before the step, or kernels two or more launches back,
            # complete once the kernel before passed its own wait): load them before the wait too
            if not EARLY_QK:
                pdl_wait(USE_PDL)
            cs = cs_ptr + tl.load(pos_ptr + b) * stride_cs
            qw, qwp, cos, sin = _norm_rope_params(qw_ptr, cs, G, HAS_NORM, False, G_PAD, D, D_PAD, ROT)
            kw, kwp, _, _ = _norm_rope_params(kw_ptr, cs, 1, HAS_NORM, False, 2, D, D_PAD, ROT)
            slot = tl.load(slot_ptr + b).to(tl.int64)
            if EARLY_QK:
                pdl_wait(USE_PDL)  # the qkv row comes from the kernel before
            row = q_ptr + b.to(tl.int64) * stride_qb
            q = _norm_rope_apply(row + kvh * G * D, qw, qwp, cos, sin, G, eps, HAS_NORM, False, G_PAD, D, D_PAD, ROT)
            q = q.to(q_ptr.dtype.element_ty)
            if split == n_active - 1:
                if slot >= 0:
                    blk = slot // BLOCK_SIZE
                    tok = slot % BLOCK_SIZE
                    k_new = _norm_rope_apply(row + (Hq + kvh) * D, kw, kwp, cos, sin, 1, eps, HAS_NORM, False, 2, D,
                                             D_PAD, ROT)
                    one = tl.arange(0, 2)[:, None] < 1
                    k_dst = k_ptr + blk * stride_kb + tok * stride_kt + kvh * stride_kh
                    tl.store(k_dst + tl.arange(0, 2)[:, None] * 0 + offs_d[None, :],
                             k_new.to(k_ptr.dtype.element_ty), mask=one & dmask[None, :])
                    v_new = tl.load(row + (Hq + tl.num_programs(1) + kvh) * D + offs_d, mask=dmask, other=0.0)
                    tl.store(v_ptr + blk * stride_vb + tok * stride_vt + kvh * stride_vh + offs_d,
                             v_new.to(v_ptr.dtype.element_ty), mask=dmask)
                    is_new = (offs_n0 == seq_len - 1)[:, None]   # into the prefetched tile, if there
                    k_row = tl.sum(tl.where(one, k_new, 0.0), axis=0).to(k_ptr.dtype.element_ty)
                    k0 = tl.where(is_new, k_row[None, :], k0)
                    v0 = tl.where(is_new, v_new.to(v_ptr.dtype.element_ty)[None, :], v0)
                tl.debug_barrier()  # the CTA's own k/v stores are visible to its later tiles' loads
        else:
            q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=qmask, other=0.0)
        acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
        m_i = tl.full([G_PAD], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        q_pos = tl.zeros([G_PAD], dtype=tl.int32)  # unused: decode needs only the bound
        first = start
        if FUSE_QK:  # the prefetched tile (all masked in an idle split: no change)
            p, alpha, m_i, l_i = _attn_scores(m_i, l_i, q, k0, (offs_n0 < end)[None, :], qk_scale, IEEE)
            acc = _attn_pv(acc, alpha, p, v0, IEEE)
            first = start + BLOCK_N
        for start_n in range(first, end, BLOCK_N):
            acc, m_i, l_i = _attn_tile(
                acc, m_i, l_i, q, k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh, bt,
                start_n, end, q_pos, qk_scale, stride_kb, stride_kt, stride_vb, stride_vt,
                offs_d, dmask,
                BLOCK_N, BLOCK_SIZE, False, IEEE, EARLY_V)
        if ZERO_BLOCK > 0:
            if split == 0:
                offs_z = (b * tl.num_programs(1) + kvh) * ZERO_BLOCK + tl.arange(0, ZERO_BLOCK)
                tl.store(zero_ptr + offs_z, tl.zeros([ZERO_BLOCK], dtype=tl.float32), mask=offs_z < zero_n)
        pdl_launch_dependents(USE_PDL)
        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=qmask)
        else:
            # partials laid out [B, Hq, NUM_SPLITS] (+ [D_PAD] for acc)
            row = (b * (tl.num_programs(1) * G) + heads).to(tl.int64) * NUM_SPLITS + split
            keep = gmask & ((split < n_active) | (not FUSED_REDUCE))  # the fused combine skips idle splits
            tl.store(m_ptr + row, m_i, mask=keep)
            tl.store(l_ptr + row, l_i, mask=keep)
            tl.store(acc_ptr + row[:, None] * D_PAD + offs_d[None, :], acc, mask=keep[:, None])
            if FUSED_REDUCE:
                # The split that finishes last for this (sequence, kv head) combines all of
                # them: one launch instead of two. acq_rel orders the partial stores above.
                slot = cnt_ptr + b * tl.num_programs(1) + kvh
                done = tl.atomic_add(slot, 1, sem="acq_rel")
                if done == (n_active if IDLE_EXIT else NUM_SPLITS) - 1:
                    _combine_splits(m_ptr, l_ptr, acc_ptr, out_ptr, b, kvh * G, G, n_active,
                                    (b * (tl.num_programs(1) * G) + kvh * G).to(tl.int64) * NUM_SPLITS,
                                    stride_ob, stride_oh, NUM_SPLITS, G_COMB, COMBINE, D, D_PAD)
                    tl.atomic_xchg(slot, 0)  # ready for the next launch (CUDA graph replays too)


@triton.jit
def _decode_reduce_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, stride_ob, stride_oh, Hq,
    NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = (b * Hq + h).to(tl.int64) * NUM_SPLITS
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    smask = offs_s < NUM_SPLITS
    m = tl.load(m_ptr + row + offs_s, mask=smask, other=-1.0e30)
    l = tl.load(l_ptr + row + offs_s, mask=smask, other=0.0)
    acc = tl.load(acc_ptr + (row + offs_s)[:, None] * D_PAD + offs_d[None, :],
                  mask=smask[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))
    total = tl.sum(w * l, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < D)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    qk_scale, G,
    G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr,
):
    qb = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len
    # rows = BLOCK_Q queries x G_PAD heads (query-major)
    offs_r = tl.arange(0, BLOCK_Q * G_PAD)
    qi = qb * BLOCK_Q + offs_r // G_PAD
    g = offs_r % G_PAD
    rmask = (qi < q_len) & (g < G)
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < D
    mask = rmask[:, None] & dmask[None, :]
    tok = (q_start + qi).to(tl.int64)
    head = kvh * G + g
    q = tl.load(q_ptr + (tok * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
                mask=mask, other=0.0)
    # padded rows get the block's last position so they never see an empty row
    q_pos = prefix + tl.minimum(qi, q_len - 1)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * G_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], dtype=tl.float32)
    bt = bt_ptr + b.to(tl.int64) * stride_bt
    kp = k_ptr + kvh * stride_kh
    vp = v_ptr + kvh * stride_vh
    first_pos = prefix + qb * BLOCK_Q
    last_pos = tl.minimum(first_pos + BLOCK_Q, seq_len)  # exclusive key bound
    # keys before the block's first query are visible to every row: no mask
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attn_tile(
            acc, m_i, l_i, q, kp, vp, bt, start_n, last_pos, q_pos, qk_scale,
            stride_kb, stride_kt, stride_vb, stride_vt, offs_d, dmask,
            BLOCK_N, BLOCK_SIZE, False, IEEE, False)
    for start_n in range(full_end, last_pos, BLOCK_N):
        acc, m_i, l_i = _attn_tile(
            acc, m_i, l_i, q, kp, vp, bt, start_n, last_pos, q_pos, qk_scale,
            stride_kb, stride_kt, stride_vb, stride_vt, offs_d, dmask,
            BLOCK_N, BLOCK_SIZE, True, IEEE, False)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (tok * stride_ot + head * stride_oh)[:, None] + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_cache(q, k_cache, v_cache):
    assert k_cache.shape == v_cache.shape and k_cache.dim() == 4
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    assert k_cache.shape[3] == d and hq % hkv == 0
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    return hq, hkv, d


# BLITZ_ATTN_MAX_SPLITS: the most splits of one sequence's context in decode (A/B runs; 1:
# one program per (sequence, KV head) walks the whole context, no partials or combine).
# H200, batch 1, 128 + 256 tokens: cap 1 qwen3-0.6b 1032 vs 1164 tok/s, llama-3.1-8b 225.5
# vs 231.4; cap 4 1159 / 232.4 (no gain): the default stays 32
_MAX_SPLITS = int(os.environ.get("BLITZ_ATTN_MAX_SPLITS", "32"))
# BLITZ_ATTN_EARLY_QK=0 (A/B): the fused decode kernel loads positions, cos/sin, q/k norm
# weights and slots after its PDL wait instead of before
_EARLY_QK = os.environ.get("BLITZ_ATTN_EARLY_QK", "1") != "0"
# BLITZ_ATTN_IDLE_EXIT=0 (A/B): splits past the context's active ones run (q/k work, an
# arrival on the counter) instead of exiting at once
_IDLE_EXIT = os.environ.get("BLITZ_ATTN_IDLE_EXIT", "1") != "0"
# BLITZ_ATTN_BLOCK_N / BLITZ_ATTN_WARPS (A/B): the decode kernel's keys per tile (default 32)
# and warps per program (default 4). H200 (scripts/gpu_session.sh tile, tile2), 32 vs 64 keys:
# qwen3-0.6b batch 1 1204.7 / 1203.2 vs 1147.9 / 1149.6 tok/s, llama-3.1-8b batch 1 236.2 vs
# 234.6, batch 64 x 1000 tokens 8877.8 vs 8066.5, qwen3-30b-a3b batch 1 348.5 vs 343.2;
# 8 warps: qwen 1211.2, llama 233.3 (kept at 4 for up to 4 query heads per KV head). With 8
# query heads per KV head (qwen3-30b-a3b: 4 KV heads, so few programs) 8 warps: 352.9 vs 346.7
# tok/s at batch 1, and 5.06 vs 5.51 us per layer for the kernel alone at a 192-token context
# (scripts/bench_attn.py --models qwen3-30b-a3b): the default there. Re-checked on qwen3-30b-a3b
# batch 1 (gpu_session.sh attn27): 64 keys per tile 403.9, 4 warps 400.3, vs 408.9 tok/s.
_DECODE_BLOCK_N = int(os.environ.get("BLITZ_ATTN_BLOCK_N", "0"))
# The decode combine loads the partials of several splits per round (the rounds' L2 round trips
# are dependent): up to 1024 fp32 values per warp, i.e. 32 per thread. With 8 query heads per KV
# head (8 warps, D 128) that is 8 splits a round, so a context of up to 256 keys takes one
# round: H200 qwen3-30b-a3b batch 1 (128 + 128 tokens), the attention's share of the step 7.18
# vs 7.52 us per layer with 4096 values (4 splits) a round, 408.4 vs 406.4 tok/s
# (scripts/gpu_session.sh overlap). BLITZ_ATTN_COMBINE_ELEMS (A/B) sets the values per round.
_COMBINE_ELEMS = int(os.environ.get("BLITZ_ATTN_COMBINE_ELEMS", "0"))
_DECODE_WARPS = int(os.environ.get("BLITZ_ATTN_WARPS", "0"))


def decode_warps(group: int) -> int:
    """Warps per decode program for ``group`` query heads per KV head (BLITZ_ATTN_WARPS wins)."""
    return _DECODE_WARPS or (8 if group >= 8 else 4)


def _default_splits(q, b, hkv):
    # enough programs to cover the GPU about twice, at most _MAX_SPLITS splits
    want = triton.cdiv(2 * device_sms(q), max(1, b * hkv))
    return max(1, min(_MAX_SPLITS, next_pow2(want)))


_MAX_COUNTERS = 1 << 16


@functools.lru_cache(maxsize=None)
def _split_counters(device: torch.device) -> torch.Tensor:
    """Zeroed arrival counters for the fused split-K reduce; every launch leaves them at 0."""
    return torch.zeros(_MAX_COUNTERS, dtype=torch.int32, device=device)


def _prefetch_args(t: torch.Tensor, ranges, programs: int) -> dict:
    """Kernel arguments of up to 4 L2 prefetch ranges (tensor, nbytes): nbytes is rounded
    down to 16 and capped at the tensor's size; misaligned or empty ranges are dropped."""
    keep = []
    if ranges and l2_prefetch_supported(t):
        for w, n in ranges:
            n = min(int(n), w.numel() * w.element_size()) // 16 * 16
            if n > 0 and w.is_cuda and w.data_ptr() % 16 == 0:
                keep.append((w, n))
    assert len(keep) <= 4, "at most 4 prefetch ranges"
    args = {}
    for i in range(4):
        w, n = keep[i] if i < len(keep) else (t, 0)
        args[f"pf{i}"], args[f"pn{i}"] = w, n
    total = max([n for _, n in keep], default=0)
    args.update(pf_chunk=l2_prefetch_chunk(total, programs), NPF=len(keep), PF_LANES=L2_PREFETCH_LANES)
    return args


def paged_decode_attention_triton(
    q, k_cache, v_cache, block_tables, seq_lens, scale,
    num_splits: Optional[int] = None, block_n: Optional[int] = None,
    num_stages: int = 2, early_v: bool = True, fused_reduce: bool = True, _fuse=None,
    l2_prefetch_ranges=(), num_warps: Optional[int] = None, early_dependents: bool = False,
    partials: bool = False, zero: Optional[torch.Tensor] = None,
):
    """``l2_prefetch_ranges``: up to 4 (tensor, nbytes) whose first nbytes the kernel asks
    the L2 to fetch while it runs (the GEMVs after it; see ``_common.l2_prefetch``);
    ignored where the GPU has no bulk prefetch. ``early_dependents`` (PDL): the next kernel
    may launch as this one starts (a GEMV that streams its weights before its wait:
    ``kernels/gemv_tma.py``). ``partials``: returns the splits' ``DecodePartials`` unmerged
    (at least 2 splits), for a consumer that merges them (``kernels/oproj_partials.py``);
    ``zero``: a contiguous fp32 tensor the launch zeroes, after its wait (that consumer's
    atomic output)."""
    hq, hkv, d = _check_cache(q, k_cache, v_cache)
    B = q.shape[0]
    if q.stride(2) != 1:
        q = q.contiguous()
    out = q if _fuse is not None else torch.empty_like(q)  # fused: q is the (empty) output buffer
    if B == 0:
        return out
    if _fuse is None:  # plain decode: q [B, Hq, D] is ready
        q_arg, stride_qb, stride_qh = q, q.stride(0), q.stride(1)
        fuse_kw = dict(pos_ptr=seq_lens, cs_ptr=seq_lens, stride_cs=0, qw_ptr=q, kw_ptr=q, slot_ptr=seq_lens,
                       Hq=hq, eps=0.0, FUSE_QK=False, HAS_NORM=False, ROT=2, EARLY_QK=False)
    else:  # q/k norm + rotary + cache write fused in: q_arg is the qkv projection output
        qkv, positions, cos_sin, qw, kw, slots, eps, rot = _fuse
        q_arg, stride_qb, stride_qh = qkv, qkv.stride(0), d
        has_norm = qw is not None
        fuse_kw = dict(pos_ptr=positions, cs_ptr=cos_sin, stride_cs=cos_sin.stride(0),
                       qw_ptr=qw if has_norm else qkv, kw_ptr=kw if has_norm else qkv, slot_ptr=slots,
                       Hq=hq, eps=float(eps), FUSE_QK=True, HAS_NORM=has_norm, ROT=rot, EARLY_QK=_EARLY_QK)
    g = hq // hkv
    s = num_splits or _default_splits(q, B, hkv)
    if partials:
        s = max(2, s)
    g_pad, d_pad = max(16, next_pow2(g)), next_pow2(d)
    bn = block_n or _DECODE_BLOCK_N or 32
    ieee = q.dtype == torch.float32
    fused = fused_reduce and not partials and s > 1 and B * hkv <= _MAX_COUNTERS
    if s > 1:
        m = torch.empty((B, hq, s), dtype=torch.float32, device=q.device)
        l_ = torch.empty_like(m)
        acc = torch.empty((B, hq, s, d_pad), dtype=torch.float32, device=q.device)
    else:
        m = l_ = acc = out
    cnt = _split_counters(q.device) if fused else seq_lens
    pdl = pdl_enabled(q) and (s == 1 or fused or partials)
    zkw = {}
    if zero is not None:
        assert zero.dtype == torch.float32 and zero.is_contiguous()
        zkw = dict(zero_ptr=zero, zero_n=zero.numel(), ZERO_BLOCK=max(16, next_pow2(triton.cdiv(zero.numel(), B * hkv))))
    g_comb = next_pow2(g)  # the combine's tiles hold the real heads only
    warps = num_warps or decode_warps(g)
    combine = max(1, min(next_pow2(s), (_COMBINE_ELEMS or 1024 * warps) // (g_comb * d_pad)))
    pf = _prefetch_args(q, l2_prefetch_ranges, B * hkv * s)
    _decode_kernel[(B, hkv, s)](
        q_arg, k_cache, v_cache, block_tables, seq_lens, out, m, l_, acc, cnt,
        stride_qb, stride_qh, out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        float(scale) * _LOG2E, g,
        NUM_SPLITS=s, G_PAD=g_pad, D=d, D_PAD=d_pad, BLOCK_N=bn,
        BLOCK_SIZE=k_cache.shape[1], IEEE=ieee, EARLY_V=early_v, FUSED_REDUCE=fused,
        USE_PDL=pdl, G_COMB=g_comb, COMBINE=combine, IDLE_EXIT=_IDLE_EXIT, **fuse_kw, **pf,
        EARLY_DEPS=bool(early_dependents) and bool(pdl), PARTIALS=bool(partials), **zkw, num_warps=warps,
        num_stages=num_stages, **pdl_launch_kwargs(pdl),
    )
    if partials:
        return DecodePartials(m, l_, acc, seq_lens, s, bn, q.dtype)
    if s > 1 and not fused:
        _decode_reduce_kernel[(B, hq)](
            m, l_, acc, out, out.stride(0), out.stride(1), hq,
            NUM_SPLITS=s, S_PAD=next_pow2(s), D=d, D_PAD=d_pad, num_warps=4,
        )
    return out


def fused_decode_attention_triton(
    qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot_mapping,
    block_tables, seq_lens, scale, q_norm_weight=None, k_norm_weight=None, eps=1e-6, rotary_dim=None,
    num_splits: Optional[int] = None, l2_prefetch_ranges=(), block_n: Optional[int] = None,
    num_warps: Optional[int] = None, early_dependents: bool = False, partials: bool = False,
    zero: Optional[torch.Tensor] = None,
):
    """One decode step of one layer in one launch: per-head q/k RMSNorm (optional) + rotary
    + writing the new k/v into the paged cache (``fused_qk_norm_rope_cache_triton``) and
    paged decode attention (``paged_decode_attention_triton``), same numerics. Each query
    token must be its sequence's only new token (a plain decode step: rows never read each
    other's new k/v). qkv [B, (Hq + 2 Hkv) * D] -> [B, Hq, D], or with ``partials`` the
    unmerged ``DecodePartials`` (``zero``: see ``paged_decode_attention_triton``)."""
    rot = _check_qk(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, rotary_dim,
                    q_norm_weight, k_norm_weight, False)
    assert (q_norm_weight is None) == (k_norm_weight is None)
    assert cos_sin_cache.shape[-1] == rot and cos_sin_cache.stride(-1) == 1
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    B = qkv.shape[0]
    out = qkv.new_empty((B, num_heads, head_dim))  # the launcher's q argument: shape, dtype, output
    return paged_decode_attention_triton(
        out, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=num_splits,
        l2_prefetch_ranges=l2_prefetch_ranges, block_n=block_n, num_warps=num_warps,
        early_dependents=early_dependents, partials=partials, zero=zero,
        _fuse=(qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, slot_mapping, eps, rot))


def paged_prefill_attention_triton(
    q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_q_len,
    block_m: Optional[int] = None, block_n: Optional[int] = None,
    num_warps: Optional[int] = None, num_stages: int = 3,
):
    hq, hkv, d = _check_cache(q, k_cache, v_cache)
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    B = seq_lens.shape[0]
    if q.shape[0] == 0 or B == 0 or max_q_len <= 0:
        return out
    g = hq // hkv
    g_pad, d_pad = next_pow2(g), next_pow2(d)
    rows = max(block_m or (128 if d_pad <= 128 else 64), 16, g_pad)
    block_q = rows // g_pad
    bn = block_n or (64 if d_pad <= 128 else 32)
    grid = (triton.cdiv(int(max_q_len), block_q), B, hkv)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        float(scale) * _LOG2E, g,
        G_PAD=g_pad, BLOCK_Q=block_q, D=d, D_PAD=d_pad, BLOCK_N=bn,
        BLOCK_SIZE=k_cache.shape[1], IEEE=q.dtype == torch.float32,
        num_warps=num_warps or (8 if rows >= 128 else 4), num_stages=num_stages,
    )
    return out


@dataclass(frozen=True)
class DecodePartials:
    """A decode launch's split partials, unmerged (``partials=True``): ``m`` / ``l`` [B, Hq, S]
    fp32 (running max in log2 units, sum of exp2), ``acc`` [B, Hq, S, D_PAD] fp32 (unnormalised
    P @ V); sequence b's splits from ``active_splits(seq_lens[b])`` on hold nothing (their
    programs exited). ``dtype``: what the merged output rounds to (the attention's)."""
    m: torch.Tensor
    l: torch.Tensor
    acc: torch.Tensor
    seq_lens: torch.Tensor
    num_splits: int
    block_n: int  # keys per tile: the split schedule's unit
    dtype: torch.dtype


def active_splits(seq_len: int, num_splits: int, block_n: int) -> int:
    """Splits holding a sequence's context (the decode kernel's schedule: as few tiles per split
    as spread the context over the splits; split 0 also for an empty context)."""
    n_tiles = -(-seq_len // block_n)
    per = max(-(-n_tiles // num_splits), 1)
    return max(-(-n_tiles // per), 1)


def merge_decode_partials(p: DecodePartials, head_dim: int) -> torch.Tensor:
    """The torch merge of ``DecodePartials``: [B, Hq, D] in p.dtype, the fused merge's formula."""
    B, hq, _ = p.m.shape
    out = torch.zeros(B, hq, head_dim, dtype=p.dtype, device=p.m.device)
    for b, n in enumerate(p.seq_lens.tolist()):
        a = active_splits(n, p.num_splits, p.block_n)
        m, l_, acc = p.m[b, :, :a], p.l[b, :, :a], p.acc[b, :, :a, :head_dim]
        w = torch.exp2(m - m.max(dim=1, keepdim=True).values)
        total = (w * l_).sum(1, keepdim=True)
        out[b] = ((acc * w[:, :, None]).sum(1) / torch.where(total > 0, total, 1.0)).to(p.dtype)
    return out


# ---------------------------------------------------------------- references
def _gather_kv(cache, table_row, n):
    bs = cache.shape[1]
    nb = (n + bs - 1) // bs
    return cache[table_row[:nb].long()].reshape(nb * bs, *cache.shape[2:])[:n].float()


def _ref_attend(q, k, v, q_pos, scale):
    """q [L, Hq, D], k/v [N, Hkv, D] (fp32); q_pos [L] positions; -> [L, Hq, D] fp32."""
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    s = torch.einsum("lhd,nhd->hln", q.float(), k) * scale
    kpos = torch.arange(k.shape[0], device=q.device)
    s = s.masked_fill(kpos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hln,nhd->lhd", torch.softmax(s, dim=-1), v)


def reference_paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
    out = torch.zeros_like(q)
    for b, n in enumerate(seq_lens.tolist()):
        if n <= 0:
            continue
        k = _gather_kv(k_cache, block_tables[b], n)
        v = _gather_kv(v_cache, block_tables[b], n)
        pos = torch.tensor([n - 1], device=q.device)
        out[b] = _ref_attend(q[b:b + 1], k, v, pos, scale)[0].to(q.dtype)
    return out


def reference_paged_prefill_attention(
    q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_q_len=None
):
    out = torch.zeros_like(q)
    qsl = query_start_loc.tolist()
    for b, n in enumerate(seq_lens.tolist()):
        s0, s1 = qsl[b], qsl[b + 1]
        if s1 <= s0:
            continue
        k = _gather_kv(k_cache, block_tables[b], n)
        v = _gather_kv(v_cache, block_tables[b], n)
        pos = torch.arange(n - (s1 - s0), n, device=q.device)
        out[s0:s1] = _ref_attend(q[s0:s1], k, v, pos, scale).to(q.dtype)
    return out


# ------------------------------------------------------------------- public
def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """q [B, Hq, D], one query per sequence at position seq_len - 1 -> [B, Hq, D]."""
    if use_triton(q):
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return reference_paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_prefill_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                            scale, max_q_len):
    """Varlen causal attention of q [T, Hq, D] over the paged cache -> [T, Hq, D]."""
    fn = paged_prefill_attention_triton if use_triton(q) else reference_paged_prefill_attention
    return fn(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_q_len)
