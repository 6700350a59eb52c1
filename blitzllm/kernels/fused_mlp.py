"""Decode MLP in one launch: ``down(silu(gate(x)) * up(x))`` for 1-2 rows.

At batch 1-2 the gated MLP is two weight streams (gate_up [2I, H], down [H, I]) with a
kernel boundary between them (the [M, I] intermediate). Here program p owns the slice
j in [p * SLICE, (p + 1) * SLICE) of the intermediate:

1. it streams the gate and up rows of its slice (fp32 FMAs, as ``gemv``'s M <= 2 path) and
   forms a[j] = silu(g[j]) * u[j] with the rounding steps of the unfused path (gate_up
   output rounded to the dtype, silu rounded, the product rounded);
2. it streams down_proj's columns of its slice ([BLOCK_N, SLICE] tiles, rows I apart) and
   adds its partial out[m, n] = sum_j Wd[n, j] a[j, m] into an fp32 workspace (relaxed
   atomics);
3. the program arriving last on the counter (acq_rel) converts the workspace to the
   output dtype, zeroes it and resets the counter, so the next launch (or CUDA-graph
   replay) starts clean.

One launch and no intermediate instead of two GEMV launches. Partials are summed in
arrival order (not bitwise reproducible run to run, like split-K). Opt-in
(``BLITZ_FUSED_MLP=1``): slower on the H200, qwen3-0.6b batch 1 1014.0 vs 1152.3 tok/s and
llama-3.1-8b 134.2 vs 234.6 (the one kernel streams its slices with too few bytes in flight).
"""
from __future__ import annotations

import functools
import os

import torch

from ._common import device_sms, next_pow2, pdl_enabled, pdl_launch_dependents, pdl_launch_kwargs, pdl_wait, tl, triton

FUSED_MLP = os.environ.get("BLITZ_FUSED_MLP", "0") == "1"
FUSED_MLP_MAX_ROWS = 2


@triton.jit
def _fused_mlp_kernel(
    x_ptr, wgu_ptr, wd_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, H, I, stride_xm, stride_om,
    M_PAD: tl.constexpr, SLICE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_OUT: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, M_PAD)
    offs_j = pid * SLICE + tl.arange(0, SLICE)
    jmask = offs_j < I
    offs_k = tl.arange(0, BLOCK_K)
    # phase 1: [SLICE, M_PAD, BLOCK_K] products of the gate / up rows of this slice
    w_k = offs_k[None, None, :]
    g_ptrs = wgu_ptr + offs_j.to(tl.int64)[:, None, None] * H + w_k
    u_ptrs = wgu_ptr + (offs_j + I).to(tl.int64)[:, None, None] * H + w_k  # up rows: I + j
    w_mask = jmask[:, None, None]
    x_ptrs = tl.broadcast_to(x_ptr + offs_m[None, :, None] * stride_xm + w_k, (SLICE, M_PAD, BLOCK_K))
    x_mask = (offs_m < M)[None, :, None]
    acc_g = tl.zeros([SLICE, M_PAD, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([SLICE, M_PAD, BLOCK_K], dtype=tl.float32)
    # the weights do not depend on the kernel before: the first tiles load before the wait
    g_cur = tl.load(g_ptrs, mask=w_mask & (w_k < H), other=0.0, eviction_policy="evict_first")
    u_cur = tl.load(u_ptrs, mask=w_mask & (w_k < H), other=0.0, eviction_policy="evict_first")
    pdl_wait(USE_PDL)
    for k in range(0, H, BLOCK_K):
        nk = k + BLOCK_K  # the next tiles stay in flight during this tile's FMAs
        g_next = tl.load(g_ptrs + nk, mask=w_mask & (w_k < H - nk), other=0.0, eviction_policy="evict_first")
        u_next = tl.load(u_ptrs + nk, mask=w_mask & (w_k < H - nk), other=0.0, eviction_policy="evict_first")
        xv = tl.load(x_ptrs + k, mask=x_mask & (w_k < H - k), other=0.0).to(tl.float32)
        acc_g += g_cur.to(tl.float32) * xv
        acc_u += u_cur.to(tl.float32) * xv
        g_cur, u_cur = g_next, u_next
    dtype = out_ptr.dtype.element_ty
    g = tl.sum(acc_g, axis=2).to(dtype).to(tl.float32)  # [SLICE, M_PAD], as the gate_up output
    u = tl.sum(acc_u, axis=2).to(dtype)
    act = (g / (1.0 + tl.exp(-g))).to(dtype)           # activation.silu_and_mul's steps
    a = (act.to(tl.float32) * u.to(tl.float32)).to(dtype).to(tl.float32)
    a = tl.where(jmask[:, None], a, 0.0)
    # phase 2: this slice's share of every output, [BLOCK_N, SLICE] tiles of down's columns
    offs_n = tl.arange(0, BLOCK_N)
    d_ptrs = wd_ptr + offs_n.to(tl.int64)[:, None] * I + offs_j[None, :]
    d_cur = tl.load(d_ptrs, mask=(offs_n < H)[:, None] & jmask[None, :], other=0.0, eviction_policy="evict_first")
    om = (offs_m < M)[None, :]
    for n0 in range(0, H, BLOCK_N):
        nn = n0 + BLOCK_N
        d_next = tl.load(d_ptrs + nn.to(tl.int64) * I, mask=(offs_n < H - nn)[:, None] & jmask[None, :], other=0.0,
                         eviction_policy="evict_first")
        part = tl.sum(d_cur.to(tl.float32)[:, :, None] * a[None, :, :], axis=1)  # [BLOCK_N, M_PAD]
        rows = n0 + offs_n
        tl.atomic_add(ws_ptr + offs_m[None, :] * H + rows[:, None], part, mask=(rows < H)[:, None] & om,
                      sem="relaxed")
        d_cur = d_next
    pdl_launch_dependents(USE_PDL)
    tl.debug_barrier()  # every thread's partials are issued before the release below
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:  # the last program: all partials are visible
        offs_o = tl.arange(0, BLOCK_OUT)
        for m in range(0, M):
            for n0 in range(0, H, BLOCK_OUT):
                cols = n0 + offs_o
                v = tl.load(ws_ptr + m * H + cols, mask=cols < H, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + m * stride_om + cols, v.to(dtype), mask=cols < H)
                tl.store(ws_ptr + m * H + cols, tl.zeros_like(v), mask=cols < H)
        tl.atomic_xchg(cnt_ptr, 0)


@functools.lru_cache(maxsize=None)
def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    """Zeroed fp32 workspace; every launch leaves it at 0."""
    return torch.zeros(numel, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=None)
def _counter(device: torch.device) -> torch.Tensor:
    """Zeroed arrival counter; every launch leaves it at 0."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def fused_mlp_config(H: int, I: int, sms: int, M: int = 1) -> dict:
    """Slice of the intermediate per program: as wide as still gives at least one program
    per SM (fewer programs, fewer atomics), 8..32; tile widths within the register budget."""
    slice_ = 32
    while slice_ > 8 and triton.cdiv(I, slice_) < sms:
        slice_ //= 2
    # SLICE x M_PAD x BLOCK_K within 4096: the two fp32 accumulators and the double-buffered gate/up
    # tiles then fit 4 warps' registers (ptxas for sm_90: 166 at 16 x 256, no spills)
    return {"SLICE": slice_, "BLOCK_K": min(4096 // (slice_ * next_pow2(M)), max(16, next_pow2(H))),
            "BLOCK_N": 64 if slice_ >= 32 else 128, "num_warps": 4}


def fused_mlp_ok(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Shapes and dtypes the kernel takes: 1-2 rows, one dtype, row-major weights."""
    H = x.shape[-1]
    return (x.dim() == 2 and 0 < x.shape[0] <= FUSED_MLP_MAX_ROWS and w_gate_up.dim() == 2 and w_down.dim() == 2
            and w_gate_up.shape[1] == H and w_gate_up.shape[0] % 2 == 0
            and tuple(w_down.shape) == (H, w_gate_up.shape[0] // 2)
            and x.dtype == w_gate_up.dtype == w_down.dtype and w_gate_up.stride(1) == 1 and w_down.stride(1) == 1
            and w_gate_up.stride(0) == H and w_down.stride(0) == w_down.shape[1])


def fused_mlp_triton(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                     config: dict | None = None) -> torch.Tensor:
    """x [M <= 2, H], w_gate_up [2I, H] (gate rows then up rows), w_down [H, I] -> [M, H]."""
    assert fused_mlp_ok(x, w_gate_up, w_down), "fused_mlp: 1-2 rows, one dtype, row-major weights"
    M, H = x.shape
    I = w_down.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((M, H), dtype=x.dtype, device=x.device)
    if I == 0 or H == 0:
        return out.zero_()
    cfg = dict(fused_mlp_config(H, I, device_sms(x), M), **(config or {}))
    ws = _workspace(x.device, next_pow2(FUSED_MLP_MAX_ROWS * H))
    pdl = pdl_enabled(x)
    grid = (triton.cdiv(I, cfg["SLICE"]),)
    _fused_mlp_kernel[grid](
        x, w_gate_up, w_down, out, ws, _counter(x.device), M, H, I, x.stride(0), out.stride(0),
        M_PAD=next_pow2(M), SLICE=cfg["SLICE"], BLOCK_K=cfg["BLOCK_K"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_OUT=min(1024, next_pow2(H)), USE_PDL=pdl, num_warps=cfg["num_warps"], num_stages=1,
        **pdl_launch_kwargs(pdl))
    return out


def reference_fused_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The unfused path's numerics: gate_up output and the activation in the dtype."""
    gu = torch.nn.functional.linear(x.float(), w_gate_up.float()).to(x.dtype)
    inter = gu.shape[-1] // 2
    act = torch.nn.functional.silu(gu[..., :inter].float()).to(x.dtype)
    a = (act.float() * gu[..., inter:].float()).to(x.dtype)
    return torch.nn.functional.linear(a.float(), w_down.float()).to(x.dtype)
