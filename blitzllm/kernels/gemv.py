"""Skinny GEMM ``y = x @ W^T (+ bias)`` for decode: x [M <= 16, K], W [N, K] row-major.

At batch 1-16 a linear layer is bound by reading W from HBM; the work per weight
is M multiply-adds. One launch reads every weight once, for all M rows, with
16-byte vector loads along K (W's contiguous dimension). Two ways to spread it:

(a) split over N (``SPLIT_K == 1``): program n owns BLOCK_N output columns,
    loops over K in BLOCK_K chunks ([BLOCK_N, BLOCK_K] tile of W plus the
    [M, BLOCK_K] slice of x, which stays in L2) and writes its [M, BLOCK_N]
    block. Enough when cdiv(N, BLOCK_N) alone fills the GPU (qkv, gate_up, lm_head).
(b) split-K in the same launch (``SPLIT_K > 1``), for small N (o_proj / down,
    small models): program (n, s) reduces the s-th BLOCK_K-aligned K range and
    adds its fp32 partial into a workspace (relaxed atomics), then, after a CTA
    barrier, bumps the n-tile's arrival counter (acq_rel). The program arriving
    last reads the total from L2, adds the bias, writes the output and zeroes its
    workspace tile and counter: no second reduce kernel, and the next call (or
    CUDA-graph replay) starts clean. Partials are summed in arrival order, so
    split-K results are not bitwise reproducible run to run.

The product is either elementwise fp32 FMAs into a [BLOCK_N, M, BLOCK_K]
accumulator reduced over K once at the end (``DOT=False``: M <= 2; x is loaded
through pointers broadcast over N, so it lands in W's register layout), or
``tl.dot`` on tensor cores (``DOT=True``: from M = 3 on, M FMAs per weight would
crowd the memory stream). fp32 accumulation either way (IEEE dot for fp32).

With ``silu_mul_input`` x is [M, 2K] (gate | up) and the GEMV input is
``silu(gate) * up`` with the numerics of ``activation.silu_and_mul``, computed
on the fly (the [M, K] intermediate never exists). Every N tile recomputes the
silu of its K range (every warp of it, with DOT), hence wide N tiles then.

``gemv_glu_triton`` takes a packed gate_up W [2I, K] and stores silu(gate) * up [M, I]:
each program's tile is BLOCK_N // 2 gate rows and the matching up rows, and its epilogue
applies the SiLU-and-mul to them (no split-K then). The swapped tensor-core form (config
``SWAP``, ``_gemv_swap_kernel``: W the MMA's wide operand, its loads pipelined through
shared memory) is there for A/B runs; the heuristic does not pick it (slower on the H200).

No host sync and no allocation per call besides the output: the split-K
workspace and counters are cached per (device, size), so once a first call
(warm-up) has created them the calls can be captured in a CUDA graph.
"""
import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F

from ._common import (device_sms, next_pow2, pdl_enabled,
                      pdl_launch_dependents, pdl_launch_kwargs, pdl_wait, tl, triton, use_triton)
from .activation import reference_silu_and_mul, silu_and_mul

GEMV_MAX_ROWS = 16
# the norm chain's sums of squares (linear_add_ss): a slot is SS_LANES lanes of SS_STRIDE
# floats (128 B apart, rows 0..GEMV_MAX_ROWS-1 used); tile n adds into lane n % SS_LANES,
# which spreads the atomics of ~1000 tiles over 32 addresses; readers sum the lanes
SS_LANES, SS_STRIDE = 32, 32
SS_SLOT = SS_LANES * SS_STRIDE
# BLITZ_GEMV_NORM=1: pre-norms run as the GEMV prologue (one kernel fewer, but measured
# slower on the H200: qwen3-0.6b 1027 vs 1133 tok/s, llama-3.1-8b 201 vs 219)
_NORM_PROLOGUE = os.environ.get("BLITZ_GEMV_NORM", "0") == "1"
# BLITZ_GEMV_PREFETCH=0: the FMA path loads each W tile when it needs it (A/B)
_FMA_PREFETCH = os.environ.get("BLITZ_GEMV_PREFETCH", "1") != "0"
# BLITZ_GEMV_DEPTH=2 (A/B): the FMA path keeps two W tiles in flight ahead of the one it
# multiplies (three register buffers) instead of one: more bytes in flight per SM; slower on the
# H200 (qwen3-0.6b batch 1 1102.2 vs 1152.3 tok/s, llama-3.1-8b 224.9 vs 234.6), so off
_FMA_DEPTH = int(os.environ.get("BLITZ_GEMV_DEPTH", "1"))
_FMA_ACC_REGS = 32  # fp32 accumulator registers per thread allowed in the FMA path
_CONFIG_KEYS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "DOT", "SWAP", "num_warps", "num_stages")


def _env_config() -> dict:
    """BLITZ_GEMV_CONFIG='{"BLOCK_N": 8, "num_warps": 4}': launch keys for every call that
    passes no config of its own (A/B runs of the heuristic)."""
    import json
    raw = os.environ.get("BLITZ_GEMV_CONFIG")
    if not raw:
        return {}
    cfg = json.loads(raw)
    unknown = set(cfg) - set(_CONFIG_KEYS) if isinstance(cfg, dict) else {"(not a JSON object)"}
    if unknown:
        raise ValueError(f"BLITZ_GEMV_CONFIG: unknown keys {sorted(unknown)}; expected {_CONFIG_KEYS}")
    return cfg


_ENV_CONFIG = _env_config()


@triton.jit
def _gemv_input(x_ptrs, mask, K, SILU_MUL: tl.constexpr, NORM: tl.constexpr, RESID: tl.constexpr,
                r_ptrs, nw_ptrs, rstd):
    """A tile of x; with SILU_MUL x_ptrs point at the gate and the tile is silu(gate) * up;
    with NORM the tile is rms_norm(x (+ residual)) given the rows' rstd (the rounding steps
    of kernels/rmsnorm.py)."""
    a = tl.load(x_ptrs, mask=mask, other=0.0)
    if SILU_MUL:  # the numerics of activation.silu_and_mul
        up = tl.load(x_ptrs + K, mask=mask, other=0.0)
        g = a.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(up.dtype)
        a = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
    if NORM:
        if RESID:
            r = tl.load(r_ptrs, mask=mask, other=0.0)
            a = (a.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        nw = tl.load(nw_ptrs, mask=mask, other=0.0)
        normed = (a.to(tl.float32) * rstd).to(a.dtype)
        a = (nw.to(tl.float32) * normed.to(tl.float32)).to(a.dtype)
    return a


@triton.jit
def _gemv_accumulate(acc, a, w, DOT: tl.constexpr, IEEE: tl.constexpr, SILU_MUL: tl.constexpr):
    """acc += a @ w^T: tensor cores (DOT) or elementwise fp32 FMAs reduced over K at the end."""
    if DOT:
        if IEEE:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    else:
        if SILU_MUL:
            a = a[None, :, :]
        acc += a.to(tl.float32) * w.to(tl.float32)
    return acc


@triton.jit
def _gemv_store(acc, b_ptr, out_ptrs, on, N, omask, HAS_BIAS: tl.constexpr,
                ADD_SS: tl.constexpr, r, ss_ptrs, ss_mask, DOT: tl.constexpr):
    """Store the [M, N] tile (+ bias) rounded to the output dtype; with ADD_SS the tile is
    first rounded as the plain output, then added to the residual tile (the sum rounded
    again: the numerics of linear + fused_add_rms_norm) and its rows' sums of squares go
    into the ss accumulator (fp32 atomics)."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + on, mask=on < N, other=0.0).to(tl.float32)
    y = acc.to(out_ptrs.dtype.element_ty)
    if ADD_SS:
        y = (y.to(tl.float32) + r.to(tl.float32)).to(out_ptrs.dtype.element_ty)
        yf = tl.where(omask, y.to(tl.float32), 0.0)
        if DOT:  # [M_PAD, BLOCK_N]
            part = tl.sum(yf * yf, axis=1)
        else:  # [BLOCK_N, M_PAD]
            part = tl.sum(yf * yf, axis=0)
        tl.atomic_add(ss_ptrs, part, mask=ss_mask, sem="relaxed")
    tl.store(out_ptrs, y, mask=omask)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, r_ptr, nw_ptr, ro_ptr, ss_ptr, ssc_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, k_per_split, n_splits, stride_rm, stride_rom, eps,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
    SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RESID: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, SS_NORM: tl.constexpr, ADD_SS: tl.constexpr,
    SS_LANES: tl.constexpr, SS_STRIDE: tl.constexpr, DEPTH: tl.constexpr = 1, GLU: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, M_PAD)
    if GLU:  # the tile's first BLOCK_N // 2 rows are gate rows, the rest the matching up rows
        r = tl.arange(0, BLOCK_N)  # (N further on in W); N is the output width here
        j = pid_n * (BLOCK_N // 2) + r % (BLOCK_N // 2)
        offs_n = j + tl.where(r < BLOCK_N // 2, 0, N)
        n_ok = j < N
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    offs_k = tl.program_id(1) * k_per_split + tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn
    if DOT:  # W tile [BN, BK], x tile [M_PAD, BK], accumulator [M_PAD, BN]
        om, on = offs_m[:, None], offs_n[None, :]
        w_k = offs_k[None, :]
        w_ptrs = w_rows[:, None] + w_k
        w_mask = n_ok[:, None]
        acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    else:  # [BN, M_PAD, BK] products, accumulator [BN, M_PAD] after the final reduction
        om, on = offs_m[None, :], offs_n[:, None]
        w_k = offs_k[None, None, :]
        w_ptrs = w_rows[:, None, None] + w_k
        w_mask = n_ok[:, None, None]
        acc = tl.zeros([BLOCK_N, M_PAD, BLOCK_K], dtype=tl.float32)
    if DOT or SILU_MUL:  # one x tile [M_PAD, BK] (the silu is not recomputed per column)
        x_k = offs_k[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + x_k
        x_mask = offs_m[:, None] < M
    else:  # x pointers broadcast over N give x the register layout of W: no shuffles
        x_k = w_k
        x_ptrs = tl.broadcast_to(x_ptr + om[:, :, None] * stride_xm + x_k, (BLOCK_N, M_PAD, BLOCK_K))
        x_mask = om[:, :, None] < M
    # W does not depend on the kernel before: its first tile loads (with PDL, while that
    # kernel ends). The FMA path then keeps the next tile's load in flight during each
    # tile's FMAs (registers double-buffered; Triton pipelines only loads feeding tl.dot).
    if PREFETCH:
        w_cur = tl.load(w_ptrs, mask=w_mask & (w_k < K), other=0.0, eviction_policy="evict_first")
        if DEPTH == 2 and not DOT:  # the split's second tile too
            w_nxt = tl.load(w_ptrs + BLOCK_K, mask=w_mask & (w_k < K - BLOCK_K) & (BLOCK_K < k_per_split),
                            other=0.0, eviction_policy="evict_first")
    r_tile = acc  # ADD_SS: the residual tile; it was written two or more launches back, which
    if ADD_SS:    # completed before the kernel before passed its own wait (PDL): load it now
        r_tile = tl.load(r_ptr + om * stride_rm + on, mask=(om < M) & (on < N), other=0.0)
    pdl_wait(USE_PDL)
    if ADD_SS:  # the other ss slot's reader ran before the kernel before: clear it for later
        if (pid_n == 0) & (tl.program_id(1) == 0):
            tl.store(ssc_ptr + tl.arange(0, SS_LANES * SS_STRIDE), tl.zeros([SS_LANES * SS_STRIDE], dtype=tl.float32))
    rstd = tl.zeros([M_PAD], dtype=tl.float32)
    r_ptrs = x_ptrs
    nw_ptrs = x_ptrs
    if NORM:  # RMSNorm prologue
        if SS_NORM:  # the rows' sums of squares were accumulated by the GEMV that made x
            # (one partial per lane: the producer's tiles spread their atomics over lanes)
            lanes = tl.arange(0, SS_LANES)[:, None] * SS_STRIDE + offs_m[None, :]
            ss = tl.sum(tl.load(ss_ptr + lanes, mask=(offs_m < M)[None, :], other=0.0), axis=0)
        else:  # every program reduces the whole (small) rows itself
            ss = tl.zeros([M_PAD], dtype=tl.float32)
            rows = offs_m[:, None]
            first = (pid_n == 0) & (tl.program_id(1) == 0)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)[None, :]
                mk = (rows < M) & (kk < K)
                v = tl.load(x_ptr + rows * stride_xm + kk, mask=mk, other=0.0)
                if RESID:
                    r = tl.load(r_ptr + rows * stride_rm + kk, mask=mk, other=0.0)
                    v = (v.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
                    if first:  # one program writes the new residual stream
                        tl.store(ro_ptr + rows * stride_rom + kk, v, mask=mk)
                vf = v.to(tl.float32)
                ss += tl.sum(vf * vf, axis=1)
        rstd = tl.rsqrt(ss / K + eps)  # as kernels/rmsnorm.py's rms_normalize
        if DOT or SILU_MUL:
            rstd = rstd[:, None]
            r_ptrs = r_ptr + offs_m[:, None] * stride_rm + x_k
            nw_ptrs = tl.broadcast_to(nw_ptr + x_k, (M_PAD, BLOCK_K))
        else:
            rstd = rstd[None, :, None]
            r_ptrs = tl.broadcast_to(r_ptr + om[:, :, None] * stride_rm + x_k, (BLOCK_N, M_PAD, BLOCK_K))
            nw_ptrs = tl.broadcast_to(nw_ptr + x_k, (BLOCK_N, M_PAD, BLOCK_K))
    # a uniform trip count (the last split may run a few fully masked chunks)
    if PREFETCH and not DOT:
        for k in range(0, k_per_split, BLOCK_K):
            nk = k + DEPTH * BLOCK_K  # the tile DEPTH ahead in this split, if any
            w_new = tl.load(w_ptrs + nk, mask=w_mask & (w_k < K - nk) & (nk < k_per_split), other=0.0,
                            eviction_policy="evict_first")
            a = _gemv_input(x_ptrs + k, x_mask & (x_k < K - k), K, SILU_MUL, NORM, RESID,
                            r_ptrs + k, nw_ptrs + k, rstd)
            acc = _gemv_accumulate(acc, a, w_cur, DOT, IEEE, SILU_MUL)
            if DEPTH == 2:
                w_cur = w_nxt
                w_nxt = w_new
            else:
                w_cur = w_new
    else:
        k_begin = 0
        if PREFETCH:  # the prefetched first tile (tensor-core path with PDL)
            a = _gemv_input(x_ptrs, x_mask & (x_k < K), K, SILU_MUL, NORM, RESID, r_ptrs, nw_ptrs, rstd)
            acc = _gemv_accumulate(acc, a, w_cur, DOT, IEEE, SILU_MUL)
            k_begin = BLOCK_K
        for k in range(k_begin, k_per_split, BLOCK_K):
            # W is streamed once: evict it first, keep x and the workspace in L2
            w = tl.load(w_ptrs + k, mask=w_mask & (w_k < K - k), other=0.0, eviction_policy="evict_first")
            a = _gemv_input(x_ptrs + k, x_mask & (x_k < K - k), K, SILU_MUL, NORM, RESID,
                            r_ptrs + k, nw_ptrs + k, rstd)
            acc = _gemv_accumulate(acc, a, w, DOT, IEEE, SILU_MUL)
    pdl_launch_dependents(USE_PDL)
    if not DOT:
        acc = tl.sum(acc, axis=2)
    if GLU:
        _gemv_glu_store(acc, b_ptr, offs_n, n_ok, out_ptr, stride_om, offs_m, pid_n, M, N, BLOCK_N, HAS_BIAS, DOT)
    else:
        _gemv_finish(acc, om, on, offs_m, pid_n, M, N, out_ptr, stride_om, ws_ptr, cnt_ptr, b_ptr, n_splits,
                     SPLIT, HAS_BIAS, ADD_SS, r_tile, ss_ptr, SS_LANES, SS_STRIDE, DOT)


@triton.jit
def _gemv_glu_store(acc, b_ptr, w_row, n_ok, out_ptr, stride_om, offs_m, pid_n, M, N,
                    BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS_FIRST: tl.constexpr):
    """GLU epilogue: the tile's gate half and up half (+ bias) rounded as the gate_up output,
    then ``silu(gate) * up`` with the numerics of activation.silu_and_mul, stored [M, BN / 2]."""
    HALF: tl.constexpr = BLOCK_N // 2
    if HAS_BIAS:
        b = tl.load(b_ptr + w_row, mask=n_ok, other=0.0).to(tl.float32)
        acc += b[None, :] if ROWS_FIRST else b[:, None]
    y = acc.to(out_ptr.dtype.element_ty)
    on_half = pid_n * HALF + tl.arange(0, HALF)
    if ROWS_FIRST:  # [M_PAD, BN] -> [M_PAD, HALF] x 2
        g, u = tl.split(tl.permute(tl.reshape(y, [y.shape[0], 2, HALF]), (0, 2, 1)))
        om, on = offs_m[:, None], on_half[None, :]
    else:  # [BN, M_PAD] -> [HALF, M_PAD] x 2
        g, u = tl.split(tl.permute(tl.reshape(y, [2, HALF, y.shape[1]]), (1, 2, 0)))
        om, on = offs_m[None, :], on_half[:, None]
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(u.dtype)
    h = (act.to(tl.float32) * u.to(tl.float32)).to(u.dtype)
    tl.store(out_ptr + om * stride_om + on, h, mask=(om < M) & (on < N))


@triton.jit
def _gemv_finish(acc, om, on, offs_m, pid_n, M, N, out_ptr, stride_om, ws_ptr, cnt_ptr, b_ptr, n_splits,
                 SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, ADD_SS: tl.constexpr, r_tile, ss_ptr,
                 SS_LANES: tl.constexpr, SS_STRIDE: tl.constexpr, ROWS_FIRST: tl.constexpr):
    """The [M, N] tile ``acc`` (index grids ``om`` / ``on``; ``ROWS_FIRST``: [M_PAD, BN],
    else [BN, M_PAD]) out: stored, or with split-K added into the workspace and stored by the
    program arriving last."""
    omask = (om < M) & (on < N)
    out_ptrs = out_ptr + om * stride_om + on
    # ADD_SS: per-row sums of squares into this tile's lane of the slot
    ss_ptrs = ss_ptr + (pid_n % SS_LANES) * SS_STRIDE + offs_m  # this tile's lane
    if SPLIT:
        ws_ptrs = ws_ptr + om * N + on
        tl.atomic_add(ws_ptrs, acc, mask=omask, sem="relaxed")
        tl.debug_barrier()  # every thread's partial is issued before the release below
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == n_splits - 1:  # last split of this n-tile: all partials are visible
            acc = tl.load(ws_ptrs, mask=omask, other=0.0, cache_modifier=".cg")  # from L2
            tl.debug_barrier()  # replicated elements: every copy is read before the reset
            tl.store(ws_ptrs, tl.zeros_like(acc), mask=omask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch
            _gemv_store(acc, b_ptr, out_ptrs, on, N, omask, HAS_BIAS, ADD_SS, r_tile, ss_ptrs,
                        offs_m < M, ROWS_FIRST)
    else:
        _gemv_store(acc, b_ptr, out_ptrs, on, N, omask, HAS_BIAS, ADD_SS, r_tile, ss_ptrs,
                    offs_m < M, ROWS_FIRST)


@triton.jit
def _gemv_swap_kernel(x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn,
                      stride_om, k_per_split, n_splits, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
                      HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr):
    """The swapped tensor-core form (``SWAP``): acc [BN, M_PAD] += W tile [BN, BK] @ x^T tile
    [BK, M_PAD]. W is the MMA's wide operand (BN of 64-128 weight rows), x the narrow one
    padded to 16 columns; ``tl.dot``'s loads are software-pipelined through shared memory
    (``num_stages`` W tiles in flight per program, as a cuBLAS GEMV kernel streams), where
    the FMA path holds one tile ahead in registers."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    k0 = tl.program_id(1) * k_per_split
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None]  # x^T tile [BK, M_PAD]
    n_ok, m_ok = offs_n[:, None] < N, offs_m[None, :] < M
    acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    k_left = K - k0
    pdl_wait(USE_PDL)
    for k in range(0, k_per_split, BLOCK_K):
        w = tl.load(w_ptrs + k, mask=n_ok & (offs_k[None, :] < k_left - k), other=0.0,
                    eviction_policy="evict_first")
        xt = tl.load(x_ptrs + k, mask=m_ok & (offs_k[:, None] < k_left - k), other=0.0)
        if IEEE:
            acc = tl.dot(w, xt, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
    pdl_launch_dependents(USE_PDL)
    _gemv_finish(acc, offs_m[None, :], offs_n[:, None], offs_m, pid_n, M, N, out_ptr, stride_om, ws_ptr,
                 cnt_ptr, b_ptr, n_splits, SPLIT, HAS_BIAS, False, acc, ws_ptr, 1, 1, False)


def _pick_split(n_tiles: int, K: int, block_k: int, sms: int) -> int:
    """Split K only when the n-tiles alone leave SMs idle; then aim at about 4x SMs programs
    (the H200 sweep: a split beside >= 1 program per SM only added atomics)."""
    if n_tiles >= sms:
        return 1
    return max(1, min(triton.cdiv(4 * sms, n_tiles), triton.cdiv(K, block_k)))


# prefer_gemv's size limits (weights, up to 2 rows), overridable for A/B runs:
# BLITZ_GEMV_MAX_WEIGHTS (plain), BLITZ_GEMV_SILU_MAX_WEIGHTS (silu-and-mul input; -1: no limit).
# Llama-3.1-8B's down_proj (58.7M weights) as the silu-input GEMV with wider N tiles: 233.8 /
# 233.6 vs 239.7 / 239.8 tok/s with the separate SiLU-and-mul + GEMV (H200, gpu_session.sh silu)
_MAX_WEIGHTS = int(os.environ.get("BLITZ_GEMV_MAX_WEIGHTS", str(64 << 20)))
_SILU_MAX_WEIGHTS = int(os.environ.get("BLITZ_GEMV_SILU_MAX_WEIGHTS", str(32 << 20)))
_SILU_EXP_BUDGET = 8 << 20  # silu evaluations per launch the FMA-path heuristic aims under


def prefer_gemv(M: int, N: int, K: int, silu_mul_input: bool = False) -> bool:
    """Whether the GEMV beats cuBLAS for this shape (measured on the H200 with CUDA graphs,
    scripts/bench_gemv.py): up to 2 rows it wins or ties up to ~32M weights with the
    silu-and-mul fused in (above that, e.g. Llama-3.1-8B's 4096x14336 down_proj, cuBLAS's
    split-K after a separate silu-and-mul measured 235.4 vs 228.6 tok/s end to end) and up to
    64M without it (that down_proj as a SiLU-and-mul kernel then the plain GEMV: 233.4 vs
    231.6 tok/s with cuBLAS split-K + its reduce, same call; 8.19 vs 9.19 kernels per layer);
    with more rows only the smaller matrices gain (split-K where cuBLAS leaves SMs idle)."""
    if M <= 2:
        if silu_mul_input:
            return _SILU_MAX_WEIGHTS < 0 or N * K <= _SILU_MAX_WEIGHTS
        return N * K <= _MAX_WEIGHTS
    return N * K <= (16 << 20)


def gemv_config(M: int, N: int, K: int, dtype: torch.dtype, sms: int, config: Optional[dict] = None,
                silu_mul_input: bool = False) -> dict:
    """Launch parameters: the heuristic, overridden by the keys given in ``config``
    (a config without SPLIT_K gets the heuristic split for its BLOCK_N / BLOCK_K).
    Heuristic from the H200 sweep: up to 2 rows, FMA tiles of 2048-8192 weights with about
    4 programs per SM and no split (n16 k512 with 8 warps for wide N); more rows, tensor-core
    tiles n16 k256 with split-K only when the N tiles leave SMs idle."""
    config = dict(config or {})
    unknown = set(config) - set(_CONFIG_KEYS)
    if unknown:
        raise KeyError(f"unknown gemv config keys {sorted(unknown)}; expected {_CONFIG_KEYS}")
    vec_k = 32 * 16 // dtype.itemsize  # a warp-wide row of 16-byte vectors: 256 bf16, 128 fp32
    if config.get("SWAP"):  # W as the MMA's wide operand, pipelined (see _gemv_swap_kernel)
        assert not silu_mul_input, "the swapped form takes a plain input"
        bn, bk = config.get("BLOCK_N", 64), config.get("BLOCK_K", 128)
        n_tiles, chunks = triton.cdiv(N, bn), triton.cdiv(K, bk)
        split = config.get("SPLIT_K") or max(1, min(triton.cdiv(2 * sms, n_tiles), chunks))
        split = triton.cdiv(chunks, triton.cdiv(chunks, split))
        return {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "DOT": True, "SWAP": True,
                "num_warps": config.get("num_warps", 4), "num_stages": config.get("num_stages", 4)}
    dot = bool(config.get("DOT", M > 2))
    if dot and silu_mul_input:  # every warp evaluates the silu of its whole x tile:
        bn, bk, warps = 64, vec_k // 2, 2  # wide N tiles, few warps
    elif dot:
        bn, bk, warps = 16, vec_k, 4
    elif N >= 6144:
        bn, bk, warps = 16, 2 * vec_k, 8
    else:
        bn = 8
        while bn > 2 and N // bn < 4 * sms:
            bn //= 2
        bk, warps = (4 if bn == 2 else 2) * vec_k, 4
        # every program evaluates the silu of the whole x (N/bn * K exponentials): wider N tiles
        # where that count gets large (Llama-3.1-8B's down_proj: bn 4 -> 8, 14.7M -> 7.3M)
        while silu_mul_input and bn < 8 and triton.cdiv(N, bn) * K > _SILU_EXP_BUDGET:
            bn, bk = bn * 2, 2 * vec_k
    bk = config.get("BLOCK_K") or min(bk, max(16, next_pow2(K)))
    warps = config.get("num_warps", warps)
    if not dot:  # the fp32 accumulator [BN, M_PAD, BK] within the register budget
        bn = max(1, min(bn, _FMA_ACC_REGS * 32 * warps // (next_pow2(M) * bk)))
    bn = config.get("BLOCK_N", bn)
    split = config.get("SPLIT_K") or _pick_split(triton.cdiv(N, bn), K, bk, sms)
    chunks = triton.cdiv(K, bk)
    split = triton.cdiv(chunks, triton.cdiv(chunks, split))  # what BLOCK_K-aligned ranges give
    return {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "DOT": dot, "SWAP": False,
            "num_warps": warps, "num_stages": config.get("num_stages", 3 if dot else 2)}


@functools.lru_cache(maxsize=4096)
def _cached_config(M, N, K, dtype, sms, items, silu_mul_input):  # spares the host per call
    return gemv_config(M, N, K, dtype, sms, dict(items), silu_mul_input)


@functools.lru_cache(maxsize=None)
def _zeros(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """Zeroed split-K workspace / counters (power-of-two sizes); each launch leaves them at 0."""
    return torch.zeros(numel, dtype=dtype, device=device)


def _launch_operands(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                     out: Optional[torch.Tensor], n_out: int) -> tuple:
    """The checks every GEMV launch makes (rows, W row-major, bias [W rows], out [M, n_out]):
    (x with unit column stride, contiguous bias, out, made if not given)."""
    M = x.shape[0]
    assert M <= GEMV_MAX_ROWS, f"gemv handles at most {GEMV_MAX_ROWS} rows"
    assert w.stride(1) == 1, "w must be row-major (contiguous along K)"
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        assert bias.shape == (w.shape[0],)
        bias = bias.contiguous()
    if out is None:
        out = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    assert out.shape == (M, n_out) and out.stride(1) == 1
    return x, bias, out


def gemv_triton(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                silu_mul_input: bool = False, out: Optional[torch.Tensor] = None,
                config: Optional[dict] = None, norm_weight: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None, eps: float = 1e-6,
                ss: Optional[torch.Tensor] = None, add_residual: Optional[torch.Tensor] = None,
                ss_clear: Optional[torch.Tensor] = None):
    """x [M, K] (or [M, 2K] gate|up with silu_mul_input), w [N, K] -> [M, N] in x.dtype.
    With ``norm_weight`` the GEMV input is ``rms_norm(x + residual)`` (``rms_norm(x)``
    without residual) and the call returns ``(out, x + residual)`` (``(out, x)``); with
    ``ss`` too (no residual) the rows' sums of squares are taken from the slot ``ss``
    [SS_SLOT] fp32 instead of being reduced (see ``linear_add_ss``).
    With ``add_residual`` [M, N] the call returns ``linear(x) + add_residual`` (each
    rounded as unfused), adds the rows' sums of squares of that into the slot ``ss`` and
    zeroes the slot ``ss_clear`` (the other one of the pair). With PDL the residual tile
    loads before the wait on the previous kernel: ``add_residual`` must come from an
    earlier launch than the one just before (true of the norm chain)."""
    norm = norm_weight is not None
    add_ss = add_residual is not None
    assert not (norm and silu_mul_input), "norm prologue and silu-mul input do not combine"
    assert residual is None or norm, "residual only with norm_weight"
    assert not (norm and add_ss), "norm prologue and residual-add epilogue do not combine"
    assert not (norm and ss is not None and residual is not None), "ss norm takes x with its residual in"
    if ss is not None:
        assert ss.dtype == torch.float32 and ss.is_contiguous() and ss.numel() == SS_SLOT
    if add_ss:
        assert ss is not None and ss_clear is not None, "add_residual needs ss and ss_clear"
        assert ss_clear.dtype == torch.float32 and ss_clear.is_contiguous() and ss_clear.numel() == SS_SLOT
    assert x.dim() == 2 and w.dim() == 2 and x.dtype == w.dtype, "x [M, K] and w [N, K] of one dtype"
    M, (N, K) = x.shape[0], w.shape
    assert x.shape[1] == (2 * K if silu_mul_input else K), "x width must be K (2K with silu_mul_input)"
    x, bias, out = _launch_operands(x, w, bias, out, N)
    resid = residual is not None
    if resid:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        if residual.stride(1) != 1:
            residual = residual.contiguous()
    new_res = torch.empty_like(x) if resid else x
    if norm and (M == 0 or N == 0 or K == 0):  # degenerate: the unfused way
        normed = _torch_norm(x, residual, norm_weight, eps)
        return out.copy_(F.linear(normed, w, bias)), (x + residual if resid else x)
    if add_ss:
        assert add_residual.shape == (M, N) and add_residual.dtype == x.dtype
        if add_residual.stride(1) != 1:
            add_residual = add_residual.contiguous()
        if M == 0 or N == 0 or K == 0:  # degenerate: the unfused way
            y = reference_linear(x, w, bias, silu_mul_input) if K else torch.zeros_like(out)
            if K == 0 and bias is not None:
                y = bias.expand(M, N).to(x.dtype)
            s = (y.float() + add_residual.float()).to(x.dtype)
            ss[:M] += s.float().pow(2).sum(-1)  # lane 0
            ss_clear.zero_()
            return out.copy_(s)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_(bias.expand(M, N) if bias is not None else torch.zeros_like(out))
    items = config or _ENV_CONFIG
    if not config and (norm or add_ss or silu_mul_input) and items.get("SWAP"):
        items = {}  # A/B runs of the swapped form: fused calls keep the heuristic
    cfg = _cached_config(M, N, K, x.dtype, device_sms(x), tuple(sorted(items.items())), silu_mul_input)
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    n_splits, n_tiles = cfg["SPLIT_K"], triton.cdiv(N, bn)
    k_per_split = triton.cdiv(triton.cdiv(K, bk), n_splits) * bk  # the last range may be ragged
    split = n_splits > 1
    ws = _zeros(x.device, torch.float32, next_pow2(M * N)) if split else out
    cnt = _zeros(x.device, torch.int32, next_pow2(n_tiles)) if split else out
    m_pad = next_pow2(M)  # tl.dot pads small M itself
    pdl = pdl_enabled(x)
    if cfg["SWAP"]:
        assert not (norm or add_ss or silu_mul_input), "the swapped form takes a plain input"
        _gemv_swap_kernel[(n_tiles, n_splits)](
            x, w, bias if bias is not None else w, out, ws, cnt, M, N, K, x.stride(0), w.stride(0),
            out.stride(0), k_per_split, n_splits, M_PAD=max(16, m_pad), BLOCK_N=bn, BLOCK_K=bk,
            SPLIT=split, IEEE=x.dtype == torch.float32, HAS_BIAS=bias is not None, USE_PDL=pdl,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch_kwargs(pdl))
        return out
    r = residual if resid else (add_residual if add_ss else x)
    ss_norm = norm and ss is not None
    _gemv_kernel[(n_tiles, n_splits)](
        x, w, bias if bias is not None else w, out, ws, cnt, r,
        norm_weight if norm else w, new_res, ss if ss is not None else ws,
        ss_clear if add_ss else ws,
        M, N, K, x.stride(0), w.stride(0), out.stride(0), k_per_split, n_splits,
        r.stride(0), new_res.stride(0), float(eps),
        M_PAD=m_pad, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, DOT=cfg["DOT"],
        IEEE=x.dtype == torch.float32, SILU_MUL=silu_mul_input, HAS_BIAS=bias is not None,
        NORM=norm, RESID=resid, USE_PDL=pdl, PREFETCH=pdl or (_FMA_PREFETCH and not cfg["DOT"]),
        SS_NORM=ss_norm, ADD_SS=add_ss, SS_LANES=SS_LANES, SS_STRIDE=SS_STRIDE, DEPTH=_FMA_DEPTH,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl_launch_kwargs(pdl),
    )
    return (out, new_res) if norm else out


def gemv_glu_triton(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                    out: Optional[torch.Tensor] = None, config: Optional[dict] = None,
                    norm_weight: Optional[torch.Tensor] = None, ss: Optional[torch.Tensor] = None,
                    eps: float = 1e-6) -> torch.Tensor:
    """``silu_and_mul(x @ w^T + bias)`` in one launch: w [2I, K] is a packed gate_up (gate
    rows, then up rows), x [M, K] -> [M, I]. Each program multiplies BLOCK_N // 2 gate rows
    and the matching up rows and applies the SiLU-and-mul to its own outputs (rounded as the
    unfused gate_up output, then as silu_and_mul), so the [M, 2I] product never exists.
    No split-K (every output needs its whole K), so the tiles alone must fill the GPU.
    With ``norm_weight`` and ``ss`` the input is ``rms_norm(x)``, the rows' sums of squares
    read from the norm chain's slot ``ss`` (see ``linear_add_ss``)."""
    assert (norm_weight is None) == (ss is None), "the norm prologue takes norm_weight and ss together"
    if ss is not None:
        assert ss.dtype == torch.float32 and ss.is_contiguous() and ss.numel() == SS_SLOT
    assert x.dim() == 2 and w.dim() == 2 and x.dtype == w.dtype, "x [M, K] and w [2I, K] of one dtype"
    M, (N2, K) = x.shape[0], w.shape
    assert N2 % 2 == 0 and x.shape[1] == K, "w must be [2I, K] and x [M, K]"
    N = N2 // 2
    x, bias, out = _launch_operands(x, w, bias, out, N)
    norm = norm_weight is not None
    if M == 0 or N == 0 or K == 0:  # degenerate: the unfused way
        if norm and M and K:
            x = _ss_rms_norm(x, ss, norm_weight, eps)
        y = reference_linear(x, w, bias) if K else torch.zeros(M, N2, dtype=x.dtype, device=x.device)
        if K == 0 and bias is not None:
            y = bias.expand(M, N2).to(x.dtype)
        return out.copy_(reference_silu_and_mul(y))
    items = dict(config or {k: v for k, v in _ENV_CONFIG.items() if k != "SWAP"})
    assert not items.get("SWAP"), "the GLU epilogue runs on the FMA / tensor-core paths"
    items["SPLIT_K"] = 1
    cfg = _cached_config(M, N2, K, x.dtype, device_sms(x), tuple(sorted(items.items())), False)
    bn = cfg["BLOCK_N"]
    assert bn >= 2, "a GLU tile holds gate and up rows: BLOCK_N >= 2"
    pdl = pdl_enabled(x)
    _gemv_kernel[(triton.cdiv(N, bn // 2), 1)](
        x, w, bias if bias is not None else w, out, out, out, x, norm_weight if norm else w, x,
        ss if norm else out, out,
        M, N, K, x.stride(0), w.stride(0), out.stride(0), triton.cdiv(K, cfg["BLOCK_K"]) * cfg["BLOCK_K"], 1,
        x.stride(0), x.stride(0), float(eps),
        M_PAD=next_pow2(M), BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"], SPLIT=False, DOT=cfg["DOT"],
        IEEE=x.dtype == torch.float32, SILU_MUL=False, HAS_BIAS=bias is not None,
        NORM=norm, RESID=False, USE_PDL=pdl, PREFETCH=pdl or (_FMA_PREFETCH and not cfg["DOT"]),
        SS_NORM=norm, ADD_SS=False, SS_LANES=SS_LANES, SS_STRIDE=SS_STRIDE, DEPTH=_FMA_DEPTH, GLU=True,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch_kwargs(pdl),
    )
    return out


# Dense MLPs at 1-2 decode rows run gate_up as the GLU GEMV (gemv_glu_triton): no SiLU-and-mul
# launch (Llama) or no SiLU recomputed by every down_proj program (Qwen3-0.6B); any size
# (Llama-3.1-8B's gate_up too: in the H200 sweep the GEMV's heuristic tile streamed it at
# 57.6 us against cuBLAS's 61.1). H200 batch 1: qwen3-0.6b 1276.7 vs 1229.8 tok/s,
# llama-3.1-8b 239.4 vs 237.9 (gpu_session.sh glu). BLITZ_GEMV_GLU=0 for A/B runs.
GLU_ENABLED = os.environ.get("BLITZ_GEMV_GLU", "1") != "0"


def glu_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``glu_linear`` takes this decode call on the GLU GEMV (1-2 rows, CUDA, half
    precision, a packed gate_up of even width; BLITZ_GEMV_GLU=0 turns it off)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return GLU_ENABLED and rows <= 2 and w.shape[0] % 2 == 0 and _gemv_ok(x, w, rows)


def glu_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu_and_mul(F.linear(x, w, bias))`` for a packed gate_up ``w`` [2I, K], x [..., K]:
    the GLU GEMV where ``glu_ok``, else the two ops."""
    if glu_ok(x, w):
        rows = x.numel() // x.shape[-1]
        y = gemv_glu_triton(x.reshape(rows, x.shape[-1]), w, bias)
        return y.view(*x.shape[:-1], w.shape[0] // 2)
    return silu_and_mul(F.linear(x, w, bias))


def _torch_norm(x, residual, norm_weight, eps):
    """The unfused numerics: rms_norm(x + residual) via kernels/rmsnorm.py's references."""
    from .rmsnorm import reference_fused_add_rms_norm, reference_rms_norm
    if residual is None:
        return reference_rms_norm(x, norm_weight, eps)
    return reference_fused_add_rms_norm(x, residual, norm_weight, eps)[0]


def reference_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     silu_mul_input: bool = False) -> torch.Tensor:
    """fp32 product (+ bias) rounded once to x.dtype; the silu-mul input rounded as unfused."""
    if silu_mul_input:
        x = reference_silu_and_mul(x)
    y = x.float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _gemv_ok(x: torch.Tensor, w: torch.Tensor, rows: int) -> bool:
    """Whether the Triton GEMV can take this call (CUDA, 1-16 rows, half precision, W row-major)."""
    return (use_triton(x) and 0 < rows <= GEMV_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and w.dtype == x.dtype and w.stride(-1) == 1)


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           silu_mul_input: bool = False) -> torch.Tensor:
    """``F.linear(x, w, bias)`` (of ``silu_and_mul(x)`` with silu_mul_input) for x [..., K].
    The GEMV kernel takes CUDA bf16/fp16 inputs of at most 16 rows; the rest goes to torch."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    ok = _gemv_ok(x, w, rows)
    if ok and prefer_gemv(rows, w.shape[0], w.shape[1], silu_mul_input):
        y = gemv_triton(x.reshape(rows, x.shape[-1]), w, bias, silu_mul_input=silu_mul_input)
        return y.view(*x.shape[:-1], w.shape[0])
    if silu_mul_input:
        x = silu_and_mul(x)
        # the product alone may still suit the GEMV (a SiLU-and-mul kernel, then the GEMV)
        if ok and prefer_gemv(rows, w.shape[0], w.shape[1]):
            y = gemv_triton(x.reshape(rows, x.shape[-1]), w, bias)
            return y.view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w, bias)


def norm_linear(x: torch.Tensor, residual: Optional[torch.Tensor], w: torch.Tensor,
                bias: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float):
    """Pre-norm projection: ``(linear(rms_norm(x + residual)), x + residual)`` (``residual``
    None: ``(linear(rms_norm(x)), x)``). On CUDA decode the norm runs as the GEMV's prologue
    (one launch instead of two); elsewhere the norm op and ``linear``."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (_NORM_PROLOGUE and _gemv_ok(x, w, rows) and norm_weight.dtype == x.dtype
            and prefer_gemv(rows, w.shape[0], w.shape[1])):
        x2 = x.reshape(rows, x.shape[-1])
        r2 = residual.reshape(rows, x.shape[-1]) if residual is not None else None
        y, new_res = gemv_triton(x2, w, bias, norm_weight=norm_weight, residual=r2, eps=eps)
        return y.view(*x.shape[:-1], w.shape[0]), new_res.view(x.shape)
    from .rmsnorm import fused_add_rms_norm
    normed, new_res = fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, w, bias), new_res


# ------------------------------------------------------------ the norm chain (decode)
# A pre-norm decoder's residual stream, as GEMV epilogues and prologues: the projection
# that ends a sub-block (o_proj, down_proj) adds its output to the residual and leaves the
# rows' sums of squares of the sum in a slot (``linear_add_ss``); the projection after the
# RMSNorm (gate_up, the next layer's qkv) normalises its input tiles with them
# (``ss_norm_linear``). No RMSNorm launch between them and no row reduction in the GEMV.
# Two slots alternate: each producer accumulates into its slot and zeroes the other one,
# whose reader ran before the kernel before it (stream order): every launch leaves the
# pair ready for the next, CUDA-graph replays included.

@functools.lru_cache(maxsize=None)
def sum_squares_slots(device: torch.device) -> torch.Tensor:
    """The chain's two zeroed sums-of-squares slots [2, SS_SLOT] fp32 of a device."""
    return torch.zeros(2, SS_SLOT, dtype=torch.float32, device=device)


def slot_sums(ss: torch.Tensor, rows: int) -> torch.Tensor:
    """The rows' sums of squares held by a slot: its lanes added up."""
    return ss.view(SS_LANES, SS_STRIDE)[:, :rows].sum(0)


def linear_add_ss(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                  ss: torch.Tensor, ss_clear: torch.Tensor, silu_mul_input: bool = False) -> torch.Tensor:
    """``s = linear(x) + residual`` (each rounded as the unfused ops: the new residual
    stream), ``ss[:rows] += sum(s * s, -1)`` in fp32 and ``ss_clear`` zeroed. One GEMV
    launch on CUDA decode; the torch ops elsewhere. ``residual`` must not be the output of
    the launch just before (see gemv_triton)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if _gemv_ok(x, w, rows):
        s = gemv_triton(x.reshape(rows, x.shape[-1]), w, bias, silu_mul_input=silu_mul_input,
                        add_residual=residual.reshape(rows, w.shape[0]), ss=ss, ss_clear=ss_clear)
        return s.view(*x.shape[:-1], w.shape[0])
    y = linear(x, w, bias, silu_mul_input=silu_mul_input)
    s = (y.float() + residual.float()).to(y.dtype)
    ss[:rows] += s.float().pow(2).sum(-1).reshape(rows)  # lane 0
    ss_clear.zero_()
    return s


def _ss_rms_norm(s: torch.Tensor, ss: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(s) [rows, K] with the rows' sums of squares from the slot ``ss`` (the rounding
    steps of the GEMV's norm prologue)."""
    rstd = torch.rsqrt(slot_sums(ss, s.shape[0]) / s.shape[-1] + eps).view(-1, 1)
    normed = (s.float() * rstd).to(s.dtype)
    return (norm_weight.float() * normed.float()).to(s.dtype)


def ss_norm_glu(s: torch.Tensor, ss: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``silu_and_mul(linear(rms_norm(s)))`` for a packed gate_up ``w``, the rows' sums of
    squares of ``s`` taken from ``ss``: the GLU GEMV with the norm prologue where ``glu_ok``."""
    rows = s.numel() // s.shape[-1] if s.shape[-1] else 0
    s2 = s.reshape(rows, s.shape[-1])
    if glu_ok(s, w) and norm_weight.dtype == s.dtype:
        y = gemv_glu_triton(s2, w, bias, norm_weight=norm_weight, ss=ss, eps=eps)
    else:
        y = silu_and_mul(F.linear(_ss_rms_norm(s2, ss, norm_weight, eps), w, bias))
    return y.view(*s.shape[:-1], w.shape[0] // 2)


def ss_norm_linear(s: torch.Tensor, ss: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                   norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``linear(rms_norm(s))`` with the rows' sums of squares of ``s`` taken from ``ss``
    (left there by ``linear_add_ss``); the norm runs as the GEMV's prologue on CUDA decode."""
    rows = s.numel() // s.shape[-1] if s.shape[-1] else 0
    if _gemv_ok(s, w, rows) and norm_weight.dtype == s.dtype:
        y, _ = gemv_triton(s.reshape(rows, s.shape[-1]), w, bias, norm_weight=norm_weight, ss=ss, eps=eps)
        return y.view(*s.shape[:-1], w.shape[0])
    normed = _ss_rms_norm(s.reshape(rows, s.shape[-1]), ss, norm_weight, eps).view(s.shape)
    return linear(normed, w, bias)
