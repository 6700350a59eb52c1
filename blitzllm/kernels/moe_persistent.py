"""The routed experts of a decode step in one persistent launch (``fused_moe_persistent_triton``).

The direct decode path of ``fused_moe`` runs two launches: the gate/up GEMM (one program per
(entry, n-tile); at batch 1 on Qwen3-30B-A3B 8 x 12 = 96 programs, so 36 of the H200's 132
SMs stream nothing) and the down GEMM with the weighted combine, which may start only when
every gate/up program has finished. Here a grid of one or two programs per SM runs two
flattened tile loops (``tl.range(..., flatten=True)``: the compiler's load pipeline runs on
from one tile into the next): gate/up tiles (16 gate rows and the matching up rows of one
entry's expert over the whole hidden size, SiLU-and-mul in the epilogue; 384 tiles at batch 1,
evenly spread), then, once every program's gate/up tiles are in, down tiles (16 output rows of
one token over all its K experts, each expert's output rounded, weighted and summed in order:
the combine without atomics, deterministic, the numerics of ``moe.reference_fused_moe``). While
it waits, a program asks the L2 (Hopper bulk prefetch) for its first down tile's weights.

The wait is a spin on an arrival counter (release / acquire) that the launch leaves at zero
(CUDA-graph replays): it needs every program resident at once, so the grid is at most
``PER_SM`` programs per SM and never more than the compiled kernel's registers and shared
memory allow (checked after the first launch, which runs one per SM). The interpreter runs
programs one after another, so there (and with ``phases=True``) the kernel runs as two
launches, gate/up loop then down loop, without the spin.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from ._common import _bulk_prefetch, device_sms, l2_prefetchable, next_pow2, pdl_enabled, pdl_launch_dependents, pdl_launch_kwargs, pdl_wait, tl, triton
from .fused_moe import _mma

# BLITZ_MOE_PERSISTENT=1: decode batches of up to PERSISTENT_MAX_ENTRIES (token, k) entries run
# the routed experts as this one persistent launch instead of the direct path's two.
MOE_PERSISTENT = os.environ.get("BLITZ_MOE_PERSISTENT", "0") == "1"
PERSISTENT_MAX_ENTRIES = 16
# BLITZ_MOE_PERSISTENT_CONFIG='{"DOT": true, "BLOCK_N_UP": 32, ...}': the tiles of calls that pass
# no config (A/B runs)
_ENV_CONFIG = os.environ.get("BLITZ_MOE_PERSISTENT_CONFIG")
CONFIG_KEYS = ("BLOCK_N_UP", "BLOCK_K_UP", "BLOCK_N_DOWN", "BLOCK_K_DOWN", "PER_SM", "PF_DOWN", "num_warps",
               "num_stages")


@triton.jit
def _moe_persistent_kernel(x_ptr, w13_ptr, w2_ptr, ids_ptr, tw_ptr, act_ptr, out_ptr, cnt_ptr,
                           H, I, n_entries, n_tokens, stride_x, stride_ue, stride_un, stride_de, stride_dn,
                           stride_a, stride_o,
                           TOP_K: tl.constexpr, BN_UP: tl.constexpr, BK_UP: tl.constexpr,
                           BN_DOWN: tl.constexpr, BK_DOWN: tl.constexpr, NPROG: tl.constexpr,
                           PHASE: tl.constexpr, PF_DOWN: tl.constexpr, USE_PDL: tl.constexpr, IEEE: tl.constexpr,
                           ELT: tl.constexpr = 2):
    """PHASE 0: both loops, the down loop after every program's gate/up tiles have arrived
    (GPU, one launch); 1: the gate/up loop only; 2: the down loop only (the interpreter).
    Both loops are flattened (``tl.range(..., flatten=True)``), so the compiler's load
    pipeline runs on from one tile into the next instead of draining per tile."""
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    dt = out_ptr.dtype.element_ty
    row0 = tl.arange(0, 16) == 0   # tensor-core tiles: the one real row padded to 16
    n_up = n_entries * tl.cdiv(I, BN_UP)
    down_per = tl.cdiv(H, BN_DOWN)
    if PHASE != 2:  # ---- gate/up tiles (entry m, rows j*BN ..): act = silu(gate) * up
        offs_k = tl.arange(0, BK_UP)
        for tile in tl.range(pid, n_up, NPROG, flatten=True):
            m = tile % n_entries
            offs_n = (tile // n_entries) * BN_UP + tl.arange(0, BN_UP)
            e = tl.load(ids_ptr + m).to(tl.int64)
            b_ok = (offs_n[None, :] < I) & (e >= 0)
            b_ptrs = w13_ptr + tl.maximum(e, 0) * stride_ue + offs_n.to(tl.int64)[None, :] * stride_un + offs_k[:, None]
            a_ptrs = x_ptr + (m // TOP_K).to(tl.int64) * stride_x + offs_k[None, :] + tl.zeros([16, 1], dtype=tl.int64)
            acc_g = tl.zeros([16, BN_UP], dtype=tl.float32)
            acc_u = tl.zeros([16, BN_UP], dtype=tl.float32)
            for k in range(0, H, BK_UP):
                a = tl.load(a_ptrs + k, mask=row0[:, None] & (offs_k[None, :] < H - k), other=0.0)
                b_mask = b_ok & (offs_k[:, None] < H - k)
                acc_g = _mma(a, tl.load(b_ptrs + k, mask=b_mask, other=0.0, eviction_policy="evict_first"),
                             acc_g, IEEE)
                acc_u = _mma(a, tl.load(b_ptrs + k + I * stride_un, mask=b_mask, other=0.0,
                                        eviction_policy="evict_first"), acc_u, IEEE)
            g = tl.sum(tl.where(row0[:, None], acc_g, 0.0), axis=0).to(dt).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(dt)   # the rounding steps of activation.silu_and_mul
            u = tl.sum(tl.where(row0[:, None], acc_u, 0.0), axis=0).to(dt).to(tl.float32)
            tl.store(act_ptr + m * stride_a + offs_n, (act.to(tl.float32) * u).to(dt), mask=(offs_n < I) & (e >= 0))
    if PHASE != 1:  # ---- down tiles (token t, rows j*BN ..): out = sum_k w_k * round(W2_k . act_k)
        n_down = n_tokens * down_per
        offs_k = tl.arange(0, BK_DOWN)
        k_steps = tl.cdiv(I, BK_DOWN)
        if PF_DOWN:  # the first down tile's weights (contiguous rows per expert) into L2 meanwhile
            if pid < n_down:
                t0 = pid // down_per
                rows = (pid % down_per) * BN_DOWN
                lane = tl.arange(0, 16)
                e_pf = tl.load(ids_ptr + t0 * TOP_K + lane, mask=lane < TOP_K, other=-1).to(tl.int64)
                nbytes = (tl.minimum(H - rows, BN_DOWN) * stride_dn * ELT).to(tl.int32)
                issued = _bulk_prefetch((w2_ptr + tl.maximum(e_pf, 0) * stride_de + rows * stride_dn).to(
                    tl.pointer_type(tl.int8)), tl.where(e_pf >= 0, nbytes, 0))
                tl.store(cnt_ptr + 8 + lane, issued, mask=issued != 0)   # never: keeps the asm
        if PHASE == 0:  # every gate/up tile of every program is in
            tl.debug_barrier()   # (this program's act stores issued before its release)
            tl.atomic_add(cnt_ptr, 1, sem="release")
            seen = tl.atomic_add(cnt_ptr, 0, sem="acquire")
            while seen < NPROG:
                seen = tl.atomic_add(cnt_ptr, 0, sem="acquire")
        for tile in tl.range(pid, n_down, NPROG, flatten=True):
            t = tile // down_per
            offs_n = (tile % down_per) * BN_DOWN + tl.arange(0, BN_DOWN)
            total = tl.zeros([16, BN_DOWN], dtype=tl.float32)
            acc = tl.zeros([16, BN_DOWN], dtype=tl.float32)
            for q in range(0, TOP_K * k_steps):   # entry q // k_steps, K chunk q % k_steps
                ent = t * TOP_K + q // k_steps
                k = (q % k_steps) * BK_DOWN
                e = tl.load(ids_ptr + ent).to(tl.int64)
                a = tl.load(act_ptr + ent * stride_a + k + offs_k[None, :] + tl.zeros([16, 1], dtype=tl.int64),
                            mask=row0[:, None] & (offs_k[None, :] < I - k) & (e >= 0), other=0.0, cache_modifier=".cg")
                b = tl.load(w2_ptr + tl.maximum(e, 0) * stride_de + offs_n.to(tl.int64)[None, :] * stride_dn
                            + k + offs_k[:, None], mask=(offs_n[None, :] < H) & (offs_k[:, None] < I - k) & (e >= 0),
                            other=0.0, eviction_policy="evict_first")
                acc = _mma(a, b, acc, IEEE)
                last = (q % k_steps) == k_steps - 1   # the entry's output, rounded, weighted, summed in order
                w = tl.load(tw_ptr + ent)
                total += tl.where(last, acc.to(dt).to(tl.float32) * w, 0.0)
                acc = tl.where(last, 0.0, acc)
            res = tl.sum(tl.where(row0[:, None], total, 0.0), axis=0)
            tl.store(out_ptr + t * stride_o + offs_n, res.to(dt), mask=offs_n < H)
        if PHASE == 0:  # the last program out resets the arrival counter for the next launch
            if tl.atomic_add(cnt_ptr + 1, 1, sem="acq_rel") == NPROG - 1:
                tl.atomic_xchg(cnt_ptr, 0)
                tl.atomic_xchg(cnt_ptr + 1, 0)
    pdl_launch_dependents(USE_PDL)


def persistent_config(tokens: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
                      config: Optional[dict] = None) -> dict:
    """Tiles: 16 gate rows (and the 16 matching up rows) and 16 down rows per tile, K chunks
    of 256 bytes, 4 warps, 4 pipeline stages, up to two programs per SM; ``config`` overrides."""
    cfg = dict(BLOCK_N_UP=16, BLOCK_K_UP=min(256 // dtype.itemsize, max(16, next_pow2(hidden))),
               BLOCK_N_DOWN=16, BLOCK_K_DOWN=min(256 // dtype.itemsize, max(16, next_pow2(inter))), PER_SM=2,
               PF_DOWN=True, num_warps=4, num_stages=4)
    unknown = set(config or {}) - set(CONFIG_KEYS)
    if unknown:
        raise KeyError(f"unknown persistent-moe config keys {sorted(unknown)}; expected {CONFIG_KEYS}")
    cfg.update(config or {})
    return cfg


@functools.lru_cache(maxsize=None)
def _counters(device: torch.device) -> torch.Tensor:
    """[0] programs whose gate/up tiles are in, [1] programs done (the launch leaves both 0),
    [8:24] the prefetch's never-taken store."""
    return torch.zeros(32, dtype=torch.int32, device=device)


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
    ``moe.reference_fused_moe``. ``phases``: True runs the gate/up and the down loop as two
    launches of the same kernel (no spinning; the default under the interpreter)."""
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
    if config is None and _ENV_CONFIG:
        import json
        config = json.loads(_ENV_CONFIG)
    cfg = persistent_config(T, K, H, inter, x.dtype, config)
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    cnt = _counters(x.device)
    tiles = max(n * triton.cdiv(inter, cfg["BLOCK_N_UP"]), T * triton.cdiv(H, cfg["BLOCK_N_DOWN"]))
    key = (cfg["BLOCK_N_UP"], cfg["BLOCK_K_UP"], cfg["BLOCK_N_DOWN"], cfg["BLOCK_K_DOWN"], cfg["num_warps"],
           cfg["num_stages"], x.dtype, x.device)
    per_sm = min(int(cfg["PER_SM"]), _RESIDENT.get(key, 1))
    programs = max(1, min(tiles, device_sms(x) * per_sm)) if x.is_cuda else min(tiles, 8)
    pf = bool(cfg["PF_DOWN"]) and not phases and l2_prefetchable(w2, w2.stride(1) * w2.element_size())
    pdl = pdl_enabled(x)
    args = (x, w13, w2, ids, tw, act, out, cnt, H, inter, n, T, x.stride(0), w13.stride(0), w13.stride(1),
            w2.stride(0), w2.stride(1), act.stride(0), out.stride(0))
    kw = dict(TOP_K=K, BN_UP=cfg["BLOCK_N_UP"], BK_UP=cfg["BLOCK_K_UP"], BN_DOWN=cfg["BLOCK_N_DOWN"],
              BK_DOWN=cfg["BLOCK_K_DOWN"], NPROG=programs, PF_DOWN=pf, IEEE=x.dtype == torch.float32, ELT=x.element_size(),
              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if phases:
        for phase in (1, 2):
            _moe_persistent_kernel[(programs,)](*args, PHASE=phase, USE_PDL=pdl, **kw, **pdl_launch_kwargs(pdl))
        return out
    compiled = _moe_persistent_kernel[(programs,)](*args, PHASE=0, USE_PDL=pdl, **kw, **pdl_launch_kwargs(pdl))
    if key not in _RESIDENT:
        _RESIDENT[key] = _resident_per_sm(compiled, cfg["num_warps"])
    return out
