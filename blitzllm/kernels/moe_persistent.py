"""The routed experts of a decode step in one persistent launch (``fused_moe_persistent_triton``).

The direct decode path of ``fused_moe`` runs two launches: the gate/up GEMM (one program per
(entry, n-tile); at batch 1 on Qwen3-30B-A3B 8 x 12 = 96 programs, so 36 of the H200's 132
SMs stream nothing) and the down GEMM with the weighted combine, which may start only when
every gate/up program has finished. Here a grid of about one program per SM walks a list of
tiles: first every gate/up tile (BLOCK_N gate rows and the matching up rows of one entry's
expert, the whole hidden size, SiLU-and-mul in the epilogue), then every down tile (BLOCK_N
rows of one entry's down weights over the whole intermediate size). Work is spread evenly
over all SMs, and a program that reaches a down tile loads its first weight chunk at once and
only then waits, spinning on an arrival counter, until all gate/up tiles of that entry have
written the entry's activation: the down weights stream while the last gate/up tiles finish,
without a launch boundary in between.

Synchronisation, all in int32 counters that the launch leaves at zero (CUDA-graph replays):
per entry the gate/up tiles done (release after a CTA barrier; the down tiles acquire it and
read the activation from L2), per entry the down tiles done (the last resets both), per
(token, n-tile) the entries done (the last sums the token's entries in entry order, weighted,
into the output: deterministic, the numerics of ``moe.reference_fused_moe``).

The spin needs every program resident at once: the grid is at most one program per SM (a
program of 8 warps; the compiled kernel's registers and shared memory are checked against
that before a second program per SM is allowed). The interpreter runs programs one after
another, so there (and with ``phases=True``) the same kernel runs twice, gate/up tiles then
down tiles, without spinning.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from ._common import device_sms, next_pow2, pdl_enabled, pdl_launch_dependents, pdl_launch_kwargs, pdl_wait, tl, triton

# BLITZ_MOE_PERSISTENT=1: decode batches of up to PERSISTENT_MAX_ENTRIES (token, k) entries run
# the routed experts as this one persistent launch instead of the direct path's two.
MOE_PERSISTENT = os.environ.get("BLITZ_MOE_PERSISTENT", "0") == "1"
PERSISTENT_MAX_ENTRIES = 16
_ENTRY_SLOTS = 16   # counters per entry kind (gate/up done, down done)
CONFIG_KEYS = ("BLOCK_N_UP", "BLOCK_K_UP", "BLOCK_N_DOWN", "BLOCK_K_DOWN", "PER_SM", "num_warps")


@triton.jit
def _moe_persistent_kernel(x_ptr, w13_ptr, w2_ptr, ids_ptr, tw_ptr, act_ptr, y_ptr, out_ptr, cnt_ptr,
                           H, I, n_entries, stride_x, stride_ue, stride_un, stride_de, stride_dn,
                           stride_a, stride_y, stride_o,
                           TOP_K: tl.constexpr, BN_UP: tl.constexpr, BK_UP: tl.constexpr,
                           BN_DOWN: tl.constexpr, BK_DOWN: tl.constexpr, PHASE: tl.constexpr,
                           USE_PDL: tl.constexpr, SLOTS: tl.constexpr):
    """PHASE 0: all tiles, down tiles wait for their entry's gate/up tiles (GPU, one launch);
    1: gate/up tiles only; 2: down tiles only (the interpreter: two launches, no waiting)."""
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    up_per = tl.cdiv(I, BN_UP)
    down_per = tl.cdiv(H, BN_DOWN)
    n_up = n_entries * up_per
    n_all = n_up + n_entries * down_per
    start = pid
    stop = n_all
    if PHASE == 1:
        stop = n_up
    if PHASE == 2:
        start = pid + n_up
    dt = out_ptr.dtype.element_ty
    for tile in range(start, stop, nprog):
        if tile < n_up:  # ---- gate/up tile: act[m, j*BN .. +BN] = silu(gate) * up
            m = tile % n_entries
            j = tile // n_entries
            e = tl.load(ids_ptr + m).to(tl.int64)
            if e >= 0:
                offs_n = j * BN_UP + tl.arange(0, BN_UP)
                offs_k = tl.arange(0, BK_UP)
                n_ok = offs_n[:, None] < I
                g_ptrs = w13_ptr + e * stride_ue + offs_n.to(tl.int64)[:, None] * stride_un + offs_k[None, :]
                u_ptrs = g_ptrs + I * stride_un
                x_row = x_ptr + (m // TOP_K).to(tl.int64) * stride_x
                acc_g = tl.zeros([BN_UP, BK_UP], dtype=tl.float32)
                acc_u = tl.zeros([BN_UP, BK_UP], dtype=tl.float32)
                wg = tl.load(g_ptrs, mask=n_ok & (offs_k[None, :] < H), other=0.0, eviction_policy="evict_first")
                wu = tl.load(u_ptrs, mask=n_ok & (offs_k[None, :] < H), other=0.0, eviction_policy="evict_first")
                for k in range(0, H, BK_UP):  # the next chunk's loads in flight during these FMAs
                    nk = k + BK_UP
                    k_nx = n_ok & (offs_k[None, :] < H - nk)
                    wg_n = tl.load(g_ptrs + nk, mask=k_nx, other=0.0, eviction_policy="evict_first")
                    wu_n = tl.load(u_ptrs + nk, mask=k_nx, other=0.0, eviction_policy="evict_first")
                    xv = tl.load(x_row + k + offs_k[None, :], mask=offs_k[None, :] < H - k, other=0.0).to(tl.float32)
                    acc_g += wg.to(tl.float32) * xv
                    acc_u += wu.to(tl.float32) * xv
                    wg = wg_n
                    wu = wu_n
                g = tl.sum(acc_g, axis=1).to(dt).to(tl.float32)
                act = (g / (1.0 + tl.exp(-g))).to(dt)
                res = (act.to(tl.float32) * tl.sum(acc_u, axis=1).to(dt).to(tl.float32)).to(dt)
                tl.store(act_ptr + m * stride_a + offs_n, res, mask=offs_n < I)
            tl.debug_barrier()  # every thread's stores are issued before the release
            tl.atomic_add(cnt_ptr + m, 1, sem="release")
        else:  # ---- down tile: y[m, j*BN .. +BN] = W2_e[rows] . act[m]
            b = tile - n_up
            m = b % n_entries
            j = b // n_entries
            e = tl.load(ids_ptr + m).to(tl.int64)
            offs_n = j * BN_DOWN + tl.arange(0, BN_DOWN)
            offs_k = tl.arange(0, BK_DOWN)
            n_ok = (offs_n[:, None] < H) & (e >= 0)
            w_ptrs = w2_ptr + tl.maximum(e, 0) * stride_de + offs_n.to(tl.int64)[:, None] * stride_dn + offs_k[None, :]
            # the weights do not depend on the gate/up tiles: the first chunk loads before the wait
            w = tl.load(w_ptrs, mask=n_ok & (offs_k[None, :] < I), other=0.0, eviction_policy="evict_first")
            if PHASE == 0:
                seen = tl.atomic_add(cnt_ptr + m, 0, sem="acquire")
                while seen < up_per:
                    seen = tl.atomic_add(cnt_ptr + m, 0, sem="acquire")
            a_row = act_ptr + m * stride_a
            acc = tl.zeros([BN_DOWN, BK_DOWN], dtype=tl.float32)
            for k in range(0, I, BK_DOWN):
                nk = k + BK_DOWN
                w_n = tl.load(w_ptrs + nk, mask=n_ok & (offs_k[None, :] < I - nk), other=0.0,
                              eviction_policy="evict_first")
                av = tl.load(a_row + k + offs_k[None, :], mask=(offs_k[None, :] < I - k) & (e >= 0), other=0.0,
                             cache_modifier=".cg").to(tl.float32)
                acc += w.to(tl.float32) * av
                w = w_n
            y = tl.sum(acc, axis=1).to(dt)
            h_ok = offs_n < H
            tl.store(y_ptr + m * stride_y + offs_n, y, mask=h_ok & (e >= 0))
            tl.debug_barrier()
            t = m // TOP_K
            slot = cnt_ptr + 2 * SLOTS + t * down_per + j
            if tl.atomic_add(slot, 1, sem="acq_rel") == TOP_K - 1:  # the token's last entry of this tile
                total = tl.zeros([BN_DOWN], dtype=tl.float32)
                for i in tl.static_range(TOP_K):
                    e_i = tl.load(ids_ptr + t * TOP_K + i)
                    y_i = tl.load(y_ptr + (t * TOP_K + i) * stride_y + offs_n, mask=h_ok & (e_i >= 0), other=0.0,
                                  cache_modifier=".cg")
                    total += y_i.to(tl.float32) * tl.load(tw_ptr + t * TOP_K + i)
                tl.store(out_ptr + t * stride_o + offs_n, total.to(dt), mask=h_ok)
                tl.atomic_xchg(slot, 0)
            if tl.atomic_add(cnt_ptr + SLOTS + m, 1, sem="acq_rel") == down_per - 1:  # the entry's last down tile
                tl.atomic_xchg(cnt_ptr + m, 0)
                tl.atomic_xchg(cnt_ptr + SLOTS + m, 0)
    pdl_launch_dependents(USE_PDL)


def persistent_config(tokens: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
                      config: Optional[dict] = None) -> dict:
    """Tiles: 16 gate rows (and the 16 matching up rows) and 16 down rows, K chunks of 512
    bytes (register double-buffered), 8 warps, one program per SM; ``config`` overrides."""
    cfg = dict(BLOCK_N_UP=16, BLOCK_K_UP=min(512 // dtype.itemsize, next_pow2(hidden)),
               BLOCK_N_DOWN=16, BLOCK_K_DOWN=min(512 // dtype.itemsize, next_pow2(inter)), PER_SM=1, num_warps=8)
    unknown = set(config or {}) - set(CONFIG_KEYS)
    if unknown:
        raise KeyError(f"unknown persistent-moe config keys {sorted(unknown)}; expected {CONFIG_KEYS}")
    cfg.update(config or {})
    return cfg


@functools.lru_cache(maxsize=None)
def _counters(device: torch.device, numel: int) -> torch.Tensor:
    return torch.zeros(numel, dtype=torch.int32, device=device)


_RESIDENT: dict = {}   # (config key) -> programs per SM the compiled kernel allows


def _resident_per_sm(compiled, num_warps: int) -> int:
    """Programs of ``compiled`` an SM holds at once (registers and shared memory; Hopper limits)."""
    try:
        regs = int(compiled.n_regs)
        smem = int(compiled.metadata.shared)
    except AttributeError:
        return 1
    by_regs = 65536 // max(1, regs * 32 * num_warps)
    by_smem = (227 * 1024) // smem if smem else 32
    return max(1, min(by_regs, by_smem, 64 // num_warps))


def fused_moe_persistent_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                                topk_ids: torch.Tensor, *, config: Optional[dict] = None,
                                phases: Optional[bool] = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk weights / ids [T, K] (T * K <=
    PERSISTENT_MAX_ENTRIES; ids < 0 are skipped) -> [T, H] in x's dtype, the numerics of
    ``moe.reference_fused_moe``. ``phases``: True runs gate/up and down as two launches of the
    same kernel (no spinning; the default under the interpreter)."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    K = topk_ids.shape[-1]
    n = T * K
    if n > PERSISTENT_MAX_ENTRIES:
        raise ValueError(f"the persistent MoE launch takes up to {PERSISTENT_MAX_ENTRIES} (token, k) entries, got {n}")
    assert w13.shape == (E, 2 * inter, H) and w2.shape == (E, H, inter), "w13 [E, 2I, H] and w2 [E, H, I]"
    assert x.dtype == w13.dtype == w2.dtype, "x, w13 and w2 of one dtype"
    assert w13.stride(2) == 1 and w2.stride(2) == 1, "expert weights must be contiguous along their last dim"
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0 or H == 0:
        return out
    if inter == 0 or K == 0:
        return out.zero_()
    if phases is None:
        phases = os.environ.get("TRITON_INTERPRET", "0") == "1" or not x.is_cuda
    cfg = persistent_config(T, K, H, inter, x.dtype, config)
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(n, H, dtype=x.dtype, device=x.device)
    down_per = triton.cdiv(H, cfg["BLOCK_N_DOWN"])
    cnt = _counters(x.device, next_pow2(2 * _ENTRY_SLOTS + PERSISTENT_MAX_ENTRIES * down_per))
    tiles = n * (triton.cdiv(inter, cfg["BLOCK_N_UP"]) + down_per)
    key = (cfg["BLOCK_N_UP"], cfg["BLOCK_K_UP"], cfg["BLOCK_N_DOWN"], cfg["BLOCK_K_DOWN"], cfg["num_warps"],
           x.dtype, x.device)
    per_sm = min(int(cfg["PER_SM"]), _RESIDENT.get(key, 1))
    programs = max(1, min(tiles, device_sms(x) * per_sm)) if x.is_cuda else min(tiles, 8)
    pdl = pdl_enabled(x)
    args = (x, w13, w2, ids, tw, act, y, out, cnt, H, inter, n, x.stride(0), w13.stride(0), w13.stride(1),
            w2.stride(0), w2.stride(1), act.stride(0), y.stride(0), out.stride(0))
    kw = dict(TOP_K=K, BN_UP=cfg["BLOCK_N_UP"], BK_UP=cfg["BLOCK_K_UP"], BN_DOWN=cfg["BLOCK_N_DOWN"],
              BK_DOWN=cfg["BLOCK_K_DOWN"], SLOTS=_ENTRY_SLOTS, num_warps=cfg["num_warps"])
    if phases:
        for phase in (1, 2):
            _moe_persistent_kernel[(programs,)](*args, PHASE=phase, USE_PDL=pdl, **kw, **pdl_launch_kwargs(pdl))
        return out
    compiled = _moe_persistent_kernel[(programs,)](*args, PHASE=0, USE_PDL=pdl, **kw, **pdl_launch_kwargs(pdl))
    if key not in _RESIDENT:
        _RESIDENT[key] = _resident_per_sm(compiled, cfg["num_warps"])
    return out
