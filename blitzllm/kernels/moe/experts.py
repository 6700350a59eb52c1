"""Fused MoE experts on Triton, ``out[t] = sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))``
with ``router.reference_fused_moe``'s numerics: the sort of (token, k) entries by expert, the
grouped GEMMs, the combine, the direct (decode) path and their tiles; no host sync. Knows
nothing about routing or layers (docs/gpu-performance.md#moe-decode).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ... import envs
from .._common import (checked_config, device_sms, next_pow2, pdl_enabled, pdl_launch_dependents, pdl_launch_kwargs,
                      pdl_wait, tl, triton, unit_stride)
from ..fp8_weights import FP8_DTYPE, fp8_block_k

MOE_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
# Decode batches of up to this many (token, k) entries run the direct path: no sort, an entry
# per program row block, the combine inside the down GEMM (two launches instead of four).
MOE_DIRECT_MAX_ENTRIES = 16


def _env_decode_config() -> tuple:
    """(gate/up keys, down keys) of BLITZ_MOE_DECODE_CONFIG ('{"BLOCK_N": 32, ...}' for both GEMMs,
    '{"up": {...}, "down": {...}}' apart) for direct-path calls that pass no config of their own."""
    cfg = envs.get("BLITZ_MOE_DECODE_CONFIG")
    if not cfg:
        return {}, {}
    split = isinstance(cfg, dict) and bool(set(cfg) & {"up", "down"})
    parts = (cfg.get("up", {}), cfg.get("down", {})) if split else (cfg, cfg)
    for part in parts:
        if not isinstance(part, dict) or set(part) - set(MOE_CONFIG_KEYS) or (split and set(cfg) - {"up", "down"}):
            raise ValueError(f"BLITZ_MOE_DECODE_CONFIG: expected a JSON object of {MOE_CONFIG_KEYS}, or of 'up' / "
                             f"'down' objects of them; got {cfg!r}")
    return parts

ALIGN_ONE_PROGRAM_MAX = 256  # (token, k) entries sorted by a single program
ALIGN_SLICE = 256  # entries per program of the two-pass sort (at most ALIGN_MAX_PROGRAMS)
ALIGN_MAX_PROGRAMS = 128


# ---- sorting the entries by expert ------------------------------------------------------

@triton.jit
def _count_experts(ids_ptr, start, stop, n_entries, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c in range(start, stop, CHUNK):
        i = c + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + i, mask=i < n_entries, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    return counts


@triton.jit
def _fill(ptr, start, stop, value, BLOCK: tl.constexpr):
    for q in range(start, stop, BLOCK):
        offs = q + tl.arange(0, BLOCK)
        tl.store(ptr + offs, tl.zeros([BLOCK], dtype=tl.int32) + value, mask=offs < stop)


@triton.jit
def _moe_count_kernel(ids_ptr, counts_ptr, sorted_ptr, n_entries, n_sorted, per_prog, pad_per_prog,
                      E_PAD: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr, USE_PDL: tl.constexpr):
    """Pass 1 of the two-pass sort: program p counts the experts of its slice of entries
    into counts[p] and writes the sentinel over its share of the sorted ids."""
    pdl_wait(USE_PDL)
    p = tl.program_id(0)
    q = p * pad_per_prog
    _fill(sorted_ptr, q, tl.minimum(q + pad_per_prog, n_sorted), n_entries, FILL)
    counts = _count_experts(ids_ptr, p * per_prog, (p + 1) * per_prog, n_entries, E_PAD, CHUNK)
    pdl_launch_dependents(USE_PDL)
    tl.store(counts_ptr + p * E_PAD + tl.arange(0, E_PAD), counts)


@triton.jit
def _moe_align_kernel(ids_ptr, counts_ptr, sorted_ptr, expert_ptr, total_ptr,
                      n_entries, n_sorted, n_blocks, per_prog,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                      FILL: tl.constexpr, COUNTED: tl.constexpr, USE_PDL: tl.constexpr):
    """Scatter of the entries to their sorted slots (program p: its slice, in order); program
    0 also writes the padded total and each block's expert. Without COUNTED there is one
    program and it pads and counts first."""
    pdl_wait(USE_PDL)
    p = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    if COUNTED:  # expert totals, and the entries of the slices before this one
        totals = tl.zeros([E_PAD], dtype=tl.int32)
        before = tl.zeros([E_PAD], dtype=tl.int32)
        n_prog = tl.num_programs(0)
        for r in range(0, n_prog, CHUNK):
            rows = r + tl.arange(0, CHUNK)[:, None]
            c = tl.load(counts_ptr + rows * E_PAD + experts[None, :], mask=rows < n_prog, other=0)
            totals += tl.sum(c, axis=0)
            before += tl.sum(tl.where(rows < p, c, 0), axis=0)
    else:
        _fill(sorted_ptr, 0, n_sorted, n_entries, FILL)
        totals = _count_experts(ids_ptr, 0, per_prog, n_entries, E_PAD, CHUNK)
        before = tl.zeros([E_PAD], dtype=tl.int32)
        tl.debug_barrier()  # the sentinels are stored before the scatter overwrites some
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    cursor = ends - padded + before  # the next free slot of each expert for this program
    for c in range(p * per_prog, (p + 1) * per_prog, CHUNK):
        i = c + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + i, mask=i < n_entries, other=-1)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_PAD] one-hot
        slot = tl.sum(hit * (cursor[None, :] + tl.cumsum(hit, axis=0) - 1), axis=1)
        tl.store(sorted_ptr + slot, i, mask=tl.sum(hit, axis=1) > 0)  # (ids outside [0, E) dropped)
        cursor += tl.sum(hit, axis=0)
    pdl_launch_dependents(USE_PDL)
    if p == 0:
        total = tl.sum(padded, axis=0)
        tl.store(total_ptr, total)
        for b0 in range(0, n_blocks, CHUNK):
            b = b0 + tl.arange(0, CHUNK)
            row = b * BLOCK_M
            e = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
            tl.store(expert_ptr + b, tl.where(row < total, e, -1), mask=b < n_blocks)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort the (token, k) entries of ``topk_ids`` [T, K] by expert (stable) for BLOCK_M-row blocks:
    (``sorted_ids`` [S] int32, entry t*K + k, each expert's run block-aligned and padded with the
    sentinel T*K; ``block_expert`` [S / block_m] int32, -1 past the end; ``total`` [1] int32, the
    padded length). S = T*K + min(E, T*K) * (block_m - 1) in whole blocks: sizes from shapes."""
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    n = ids.numel()
    n_blocks = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m)
    n_sorted = n_blocks * block_m
    dev = ids.device
    sorted_ids = torch.empty(n_sorted, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    if n == 0:
        return sorted_ids, block_expert, total.zero_()
    e_pad = next_pow2(num_experts)
    chunk = min(max(16, min(64, 8192 // e_pad)), max(16, next_pow2(n)))
    fill = 1024
    pdl = pdl_enabled(ids)
    common = dict(E_PAD=e_pad, CHUNK=chunk, FILL=fill, USE_PDL=pdl, num_warps=4, **pdl_launch_kwargs(pdl))
    if n <= ALIGN_ONE_PROGRAM_MAX:
        _moe_align_kernel[(1,)](ids, total, sorted_ids, block_expert, total, n, n_sorted, n_blocks,
                                triton.cdiv(n, chunk) * chunk, BLOCK_M=block_m, COUNTED=False, **common)
        return sorted_ids, block_expert, total
    per_prog = triton.cdiv(triton.cdiv(n, min(ALIGN_MAX_PROGRAMS, triton.cdiv(n, ALIGN_SLICE))), chunk) * chunk
    progs = triton.cdiv(n, per_prog)
    counts = torch.empty(progs, e_pad, dtype=torch.int32, device=dev)
    _moe_count_kernel[(progs,)](ids, counts, sorted_ids, n, n_sorted, per_prog, triton.cdiv(n_sorted, progs),
                                **common)
    _moe_align_kernel[(progs,)](ids, counts, sorted_ids, block_expert, total, n, n_sorted, n_blocks, per_prog,
                                BLOCK_M=block_m, COUNTED=True, **common)
    return sorted_ids, block_expert, total


# ---- grouped GEMMs and the combine ------------------------------------------------------

@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _fp8_tile(b, s_col, rows, row_ok, stride_sn, BN_Q: tl.constexpr, dtype: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] float8 W tile (its columns are W rows ``rows``) dequantized to
    ``dtype``: times the scale of each row's block in the scale column at ``s_col``."""
    sc = tl.load(s_col + (rows // BN_Q) * stride_sn, mask=row_ok, other=0.0)
    return (b.to(tl.float32) * sc[None, :]).to(dtype)


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ptr, expert_ptr, total_ptr,
                     N, KD, n_entries, row_div, stride_a, stride_we, stride_wn, stride_o,
                     tw_ptr, comb_ptr, cnt_ptr, stride_c,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GATED: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr,
                     DIRECT: tl.constexpr, COMBINE: tl.constexpr, TOP_K: tl.constexpr,
                     zero_ptr=None, zero_n=0, ZERO_BLOCK: tl.constexpr = 0, ATOMIC: tl.constexpr = False,
                     ws_ptr=None, stride_se=0, stride_sn=0, FP8: tl.constexpr = False,
                     BN_Q: tl.constexpr = 1, BK_Q: tl.constexpr = 1):
    """out[entry, n] = A[entry // row_div] . W[e, n] for the BLOCK_M sorted entries of one expert e.
    GATED: W holds gate rows [0, N) and up rows [N, 2N); out is silu(gate) * up, rounded as the
    reference. DIRECT (decode): no sort; program m is entry m (expert_ptr: the ids, -1 dropped:
    nothing loaded or written). COMBINE (DIRECT down GEMM): the last program of a token's n-tile
    sums it over the token's TOP_K entries, weighted (tw_ptr), in entry order, into comb_ptr;
    with ATOMIC each program instead adds its rounded output times its weight into the token's
    fp32 row with atomics (no arrival count, summation order not fixed). ZERO_BLOCK > 0: the
    programs also zero the zero_n fp32 values at zero_ptr (the gate/up launch before an ATOMIC
    down). FP8: float8 W, one fp32 scale per [BN_Q, BK_Q] block at ws_ptr, each tile widened,
    scaled and rounded to A's dtype before its MMA (BLOCK_K divides BK_Q)."""
    pdl_wait(USE_PDL)  # (PDL launches write nothing before this)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if ZERO_BLOCK > 0:  # (after the wait: the buffer's last reader ran before the kernel before)
        offs_z = (pid_m * tl.num_programs(1) + pid_n) * ZERO_BLOCK + tl.arange(0, ZERO_BLOCK)
        tl.store(zero_ptr + offs_z, tl.zeros([ZERO_BLOCK], dtype=tl.float32), mask=offs_z < zero_n)
    if DIRECT:
        expert = tl.load(expert_ptr + pid_m).to(tl.int64)
        entry = pid_m + tl.arange(0, BLOCK_M)
        row_ok = (tl.arange(0, BLOCK_M) == 0) & (expert >= 0)
        expert = tl.maximum(expert, 0)
    else:
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        expert = tl.load(expert_ptr + pid_m).to(tl.int64)
        entry = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = entry < n_entries
    offs_t = tl.arange(0, BLOCK_N)
    offs_n = pid_n * BLOCK_N + offs_t
    n_in = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (entry // row_div).to(tl.int64)[:, None] * stride_a + offs_k[None, :]
    b_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    n_ok = n_in[None, :]
    if DIRECT:  # a dropped entry loads no weights
        n_ok = n_ok & (tl.max(row_ok.to(tl.int32), axis=0) > 0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, KD, BLOCK_K):
        if EVEN_K:
            a_mask = row_ok[:, None]
            b_mask = n_ok
        else:
            a_mask = row_ok[:, None] & (offs_k[None, :] < KD - k)
            b_mask = n_ok & (offs_k[:, None] < KD - k)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if FP8:
            s_col = ws_ptr + expert * stride_se + k // BK_Q
            b = _fp8_tile(b, s_col, offs_n, n_in, stride_sn, BN_Q, a.dtype)
        acc = _mma(a, b, acc, IEEE)
        if GATED:
            b_up = tl.load(b_ptrs + N * stride_wn, mask=b_mask, other=0.0)
            if FP8:  # (the up rows are rows N.. of the expert's [2N, K] matrix and its scale grid)
                b_up = _fp8_tile(b_up, s_col, N + offs_n, n_in, stride_sn, BN_Q, a.dtype)
            acc_up = _mma(a, b_up, acc_up, IEEE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    pdl_launch_dependents(USE_PDL)
    dt = out_ptr.dtype.element_ty
    res = acc.to(dt)
    if GATED:  # silu in fp32 rounded to dt, times up (as activation.silu_and_mul)
        g = res.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt)
        res = (act.to(tl.float32) * acc_up.to(dt).to(tl.float32)).to(dt)
    if ATOMIC:  # (DIRECT: row 0 is the program's entry; a dropped entry adds nothing)
        part = tl.sum(tl.where(row_ok[:, None], res.to(tl.float32), 0.0), axis=0) * tl.load(tw_ptr + pid_m)
        keep = n_in & (tl.max(row_ok.to(tl.int32), axis=0) > 0)
        tl.atomic_add(comb_ptr + (pid_m // TOP_K) * stride_c + offs_n, part, mask=keep, sem="relaxed")
        return
    o_ptrs = out_ptr + entry.to(tl.int64)[:, None] * stride_o + offs_n[None, :]
    tl.store(o_ptrs, res, mask=row_ok[:, None] & n_ok)
    if COMBINE:
        tl.debug_barrier()  # every thread's row stores are issued before the release below
        t = pid_m // TOP_K
        slot = cnt_ptr + t * tl.num_programs(1) + pid_n
        if tl.atomic_add(slot, 1, sem="acq_rel") == TOP_K - 1:  # the token's last entry here
            n1 = n_in
            total = tl.zeros([BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(TOP_K):
                e_j = tl.load(expert_ptr + t * TOP_K + j)
                y = tl.load(out_ptr + (t * TOP_K + j) * stride_o + offs_n, mask=n1 & (e_j >= 0), other=0.0,
                            cache_modifier=".cg")
                total += y.to(tl.float32) * tl.load(tw_ptr + t * TOP_K + j)
            tl.store(comb_ptr + t * stride_c + offs_n, total.to(comb_ptr.dtype.element_ty), mask=n1)
            tl.atomic_xchg(slot, 0)  # ready for the next launch (CUDA-graph replays too)


@triton.jit
def _moe_combine_kernel(y_ptr, tw_ptr, ids_ptr, out_ptr, H, stride_o, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                        DROPPED: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        if DROPPED:  # an entry with id -1 has no expert output (the GEMMs skipped it)
            y_mask = mask & (tl.load(ids_ptr + t * TOP_K + k) >= 0)
        else:
            y_mask = mask
        y = tl.load(y_ptr + (t * TOP_K + k) * H + offs, mask=y_mask, other=0.0)
        acc += y.to(tl.float32) * tl.load(tw_ptr + t * TOP_K + k)
    pdl_launch_dependents(USE_PDL)
    tl.store(out_ptr + t * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def expected_rows_per_expert(tokens: int, top_k: int, num_experts: int) -> float:
    """Mean rows of a chosen expert when T tokens pick K of E uniformly."""
    entries = tokens * top_k
    chosen = num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** entries)
    return entries / max(chosen, 1.0)


def moe_config(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
               sms: int, config: Optional[dict] = None):
    """(gate/up config, down config): the heuristic, with the keys of ``config`` applied to both.
    Few rows per expert (decode): BLOCK_M 16, 64-wide N tiles (narrowed towards 16 only while
    the chosen experts' tiles would leave more than half the SMs idle), 256-byte K tiles, 4
    stages. Many rows (prefill): 64 x 128 tiles (64 x 64 gated), BLOCK_M 128 from 256 rows on."""
    config = checked_config(config, MOE_CONFIG_KEYS, "fused-moe")
    rows = expected_rows_per_expert(tokens, top_k, num_experts)
    chosen = tokens * top_k / rows
    bm = 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows < 256 else 128
    bm = config.get("BLOCK_M", bm)
    cfgs = []
    for n, kd, gated in ((inter, hidden, True), (hidden, inter, False)):
        if bm <= 32:  # bound by the weight stream
            bn, bk, warps, stages = 64, 256 // dtype.itemsize, 4, 4
            while bn > 16 and chosen * triton.cdiv(n, bn) < sms // 2:
                bn //= 2
        else:
            bn, bk, warps, stages = (64 if gated else 128), 128 // dtype.itemsize, 4 if bm <= 64 else 8, 3
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": min(bk, max(16, next_pow2(kd))),
               "num_warps": warps, "num_stages": stages}
        cfg.update(config)
        cfgs.append(cfg)
    return tuple(cfgs)


@functools.lru_cache(maxsize=1024)
def _moe_config_cached(tokens, top_k, num_experts, hidden, inter, dtype, sms, items):
    return moe_config(tokens, top_k, num_experts, hidden, inter, dtype, sms, dict(items))


def _grouped_gemm(a, w, out, sorted_ids, block_expert, total, n_entries, row_div, n, gated, cfg,
                  direct=False, combine=None, zero=None, atomic=False, scale=None):
    """direct: block_expert holds the entries' expert ids (one program per entry, no sort).
    combine (direct only): (fp32 topk weights [T*K], output [T, n], top_k), the weighted sum
    written by the launch (``atomic``: added into a zeroed fp32 output; ``out`` unwritten).
    zero: an fp32 tensor the launch zeroes after its PDL wait. scale: (fp32 block scales
    [E, ceil(n_w / bn), ceil(kd / bk)], (bn, bk)) of a float8 ``w``."""
    kd = a.shape[1]
    fp8 = {}
    if scale is not None:
        s, block = scale
        if block[1] % cfg["BLOCK_K"]:
            cfg = dict(cfg, BLOCK_K=fp8_block_k(block))
        fp8 = dict(ws_ptr=s, stride_se=s.stride(0), stride_sn=s.stride(1), FP8=True, BN_Q=block[0], BK_Q=block[1])
    grid = (block_expert.numel(), triton.cdiv(n, cfg["BLOCK_N"]))
    pdl = pdl_enabled(a)
    if combine is not None:
        tw, comb, top_k = combine
        cnt = comb if atomic else _counters(a.device, next_pow2(comb.shape[0] * grid[1]))
    else:
        tw, comb, cnt, top_k = out, out, out, 1
    zkw = {}
    if zero is not None and zero.numel():
        zkw = dict(zero_ptr=zero, zero_n=zero.numel(),
                   ZERO_BLOCK=max(16, next_pow2(triton.cdiv(zero.numel(), grid[0] * grid[1]))))
    _moe_gemm_kernel[grid](a, w, out, sorted_ids, block_expert, total, n, kd, n_entries, row_div,
                           a.stride(0), w.stride(0), w.stride(1), out.stride(0), tw, comb, cnt, comb.stride(0),
                           **zkw, **fp8, ATOMIC=bool(atomic and combine is not None and direct),
                           BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                           GATED=gated, EVEN_K=kd % cfg["BLOCK_K"] == 0, IEEE=a.dtype == torch.float32,
                           USE_PDL=pdl, DIRECT=direct, COMBINE=combine is not None, TOP_K=top_k,
                           num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                           **pdl_launch_kwargs(pdl))


def _configs(x, T, K, E, H, inter, config, direct) -> tuple:
    """(gate/up, down) tile configs: ``config`` for both, else the heuristic with
    BLITZ_MOE_DECODE_CONFIG's keys on the direct path."""
    keys = _env_decode_config() if config is None and direct else (config or {},) * 2
    return tuple(_moe_config_cached(T, K, E, H, inter, x.dtype, device_sms(x), tuple(sorted(k.items())))[i]
                 for i, k in enumerate(keys))


def _direct(x, w13, w2, tw, ids, out, K, up_cfg, down_cfg, s13=None, s2=None) -> torch.Tensor:
    """The direct (decode) path for flat entry ids / weights [T * K] into out [T, H]: gate/up, then
    down with the combine inside (an fp32 ``out``: zeroed by gate/up, atomic adds). ``s13`` /
    ``s2``: (scales, block) of float8 w13 / w2."""
    n, inter, H = ids.numel(), w2.shape[2], w2.shape[1]
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    atomic = out.dtype == torch.float32 and x.dtype != torch.float32
    _grouped_gemm(x, w13, act, ids, ids, ids, n, K, inter, True, dict(up_cfg, BLOCK_M=16), direct=True,
                  zero=out if atomic else None, scale=s13)
    y = act if atomic else torch.empty(n, H, dtype=x.dtype, device=x.device)  # (atomic: y unwritten)
    _grouped_gemm(act, w2, y, ids, ids, ids, n, 1, H, False, dict(down_cfg, BLOCK_M=16), direct=True,
                  combine=(tw, out, K), atomic=atomic, scale=s2)
    return out


@functools.lru_cache(maxsize=None)
def _counters(device: torch.device, numel: int) -> torch.Tensor:
    """Zeroed arrival counters of the direct path's fused combine; each launch leaves them 0."""
    return torch.zeros(numel, dtype=torch.int32, device=device)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, *, config: Optional[dict] = None,
                     dropped_ids: bool = False, direct: Optional[bool] = None,
                     fp32_sum: bool = False, scales: Optional[tuple] = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk weights / ids [T, K] -> [T, H] in x's dtype.
    ``fp32_sum``: where the direct path runs, the unrounded fp32 weighted sum (atomic adds, last
    bit not fixed), for a caller that rounds it (``rmsnorm.fused_add_rms_norm``). ``config``
    overrides MOE_CONFIG_KEYS of both GEMMs. ``dropped_ids``: ids -1 (other ranks' experts) are
    skipped. ``direct``: force the two-launch path without the sort, which skips ids < 0 (None:
    up to MOE_DIRECT_MAX_ENTRIES entries). ``scales``: (w13's, w2's fp32 block scales,
    (bn, bk)) of float8 w13 / w2, dequantized per tile."""
    assert x.dim() == 2 and w13.dim() == 3 and w2.dim() == 3, "x [T, H], w13 [E, 2I, H], w2 [E, H, I]"
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    K = topk_ids.shape[-1]
    assert w13.shape == (E, 2 * inter, H) and w2.shape == (E, H, inter), "w13 [E, 2I, H] and w2 [E, H, I]"
    assert topk_ids.shape == (T, K) and topk_weights.shape == (T, K), "topk weights / ids [T, K]"
    if scales is None:
        assert x.dtype == w13.dtype == w2.dtype, "x, w13 and w2 of one dtype"
    else:
        assert w13.dtype == w2.dtype == FP8_DTYPE, "float8 w13 and w2 with scales"
    # (scale, block) of each GEMM's float8 weights
    s13, s2 = ((scales[0], scales[2]), (scales[1], scales[2])) if scales is not None else (None, None)
    assert w13.stride(2) == 1 and w2.stride(2) == 1, "expert weights must be contiguous along their last dim"
    x = unit_stride(x)
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0 or H == 0:
        return out
    if inter == 0 or K == 0:
        return out.zero_()
    n = T * K
    if direct is None:
        direct = n <= MOE_DIRECT_MAX_ENTRIES
    up_cfg, down_cfg = _configs(x, T, K, E, H, inter, config, direct)
    if direct:  # two launches: no sort, the combine inside the down GEMM
        ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
        tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
        if fp32_sum and x.dtype != torch.float32:
            out = torch.empty(T, H, dtype=torch.float32, device=x.device)  # (zeroed by the gate/up launch)
        return _direct(x, w13, w2, tw, ids, out, K, up_cfg, down_cfg, s13=s13, s2=s2)
    sorted_ids, block_expert, total = moe_align_block_size(topk_ids, E, up_cfg["BLOCK_M"])
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, act, sorted_ids, block_expert, total, n, K, inter, True, up_cfg, scale=s13)
    y = torch.empty(n, H, dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, y, sorted_ids, block_expert, total, n, 1, H, False, down_cfg, scale=s2)
    tw = topk_weights.to(torch.float32).contiguous()
    block_h = min(1024, next_pow2(H))
    pdl = pdl_enabled(x)
    ids = topk_ids.to(torch.int32).contiguous() if dropped_ids else tw
    _moe_combine_kernel[(T, triton.cdiv(H, block_h))](y, tw, ids, out, H, out.stride(0), TOP_K=K, BLOCK_H=block_h,
                                                      DROPPED=dropped_ids, USE_PDL=pdl, num_warps=4,
                                                      **pdl_launch_kwargs(pdl))
    return out
