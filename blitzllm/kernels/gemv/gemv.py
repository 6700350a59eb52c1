"""Skinny GEMM ``y = x @ W^T (+ bias)`` for decode, x [M <= 16, K], W [N, K] row-major: the Triton
GEMV (split over N, or split-K in the same launch), its SiLU-and-mul input form, the GLU GEMV
for packed gate_up, their heuristic and when to prefer them over cuBLAS. Knows nothing about
layers (docs/gpu-performance.md#the-triton-gemv).
"""
import functools
from typing import Optional

import torch
import torch.nn.functional as F

from ... import envs
from .._common import (checked_config, device_sms, next_pow2, pdl_enabled, pdl_launch_dependents, pdl_launch_kwargs,
                      pdl_wait, tl, triton, unit_stride, use_triton)
from ..activation import reference_silu_and_mul, silu_and_mul

GEMV_MAX_ROWS = 16
_FMA_ACC_REGS = 32  # fp32 accumulator registers per thread allowed in the FMA path
_CONFIG_KEYS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "DOT", "num_warps", "num_stages")


def _env_config() -> dict:
    """BLITZ_GEMV_CONFIG='{"BLOCK_N": 8, "num_warps": 4}': launch keys for every call that
    passes no config of its own (A/B runs of the heuristic)."""
    cfg = envs.get("BLITZ_GEMV_CONFIG") or {}
    unknown = set(cfg) - set(_CONFIG_KEYS) if isinstance(cfg, dict) else {"(not a JSON object)"}
    if unknown:
        raise ValueError(f"BLITZ_GEMV_CONFIG: unknown keys {sorted(unknown)}; expected {_CONFIG_KEYS}")
    return cfg


@triton.jit
def _gemv_input(x_ptrs, mask, K, SILU_MUL: tl.constexpr):
    """A tile of x; with SILU_MUL x_ptrs point at the gate and the tile is silu(gate) * up."""
    a = tl.load(x_ptrs, mask=mask, other=0.0)
    if SILU_MUL:  # the numerics of activation.silu_and_mul
        up = tl.load(x_ptrs + K, mask=mask, other=0.0)
        g = a.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(up.dtype)
        a = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
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
def _gemv_store(acc, b_ptr, out_ptrs, on, N, omask, HAS_BIAS: tl.constexpr):
    """Store the [M, N] tile (+ bias) rounded to the output dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + on, mask=on < N, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=omask)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, k_per_split, n_splits,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
    SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr, GLU: tl.constexpr = False,
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
    # W does not depend on the kernel before: its first tile loads before the PDL wait; the
    # FMA path then keeps the next tile's load in flight during each tile's FMAs.
    PREFETCH: tl.constexpr = USE_PDL or not DOT
    if PREFETCH:
        w_cur = tl.load(w_ptrs, mask=w_mask & (w_k < K), other=0.0, eviction_policy="evict_first")
    pdl_wait(USE_PDL)
    # a uniform trip count (the last split may run a few fully masked chunks)
    if not DOT:
        for k in range(0, k_per_split, BLOCK_K):
            nk = k + BLOCK_K  # the next tile in this split, if any
            w_new = tl.load(w_ptrs + nk, mask=w_mask & (w_k < K - nk) & (nk < k_per_split), other=0.0,
                            eviction_policy="evict_first")
            a = _gemv_input(x_ptrs + k, x_mask & (x_k < K - k), K, SILU_MUL)
            acc = _gemv_accumulate(acc, a, w_cur, DOT, IEEE, SILU_MUL)
            w_cur = w_new
    else:
        k_begin = 0
        if PREFETCH:  # the prefetched first tile (with PDL)
            a = _gemv_input(x_ptrs, x_mask & (x_k < K), K, SILU_MUL)
            acc = _gemv_accumulate(acc, a, w_cur, DOT, IEEE, SILU_MUL)
            k_begin = BLOCK_K
        for k in range(k_begin, k_per_split, BLOCK_K):
            # W is streamed once: evict it first, keep x and the workspace in L2
            w = tl.load(w_ptrs + k, mask=w_mask & (w_k < K - k), other=0.0, eviction_policy="evict_first")
            a = _gemv_input(x_ptrs + k, x_mask & (x_k < K - k), K, SILU_MUL)
            acc = _gemv_accumulate(acc, a, w, DOT, IEEE, SILU_MUL)
    pdl_launch_dependents(USE_PDL)
    if not DOT:
        acc = tl.sum(acc, axis=2)
    if GLU:
        _gemv_glu_store(acc, b_ptr, offs_n, n_ok, out_ptr, stride_om, offs_m, pid_n, M, N, BLOCK_N, HAS_BIAS, DOT)
    else:
        _gemv_finish(acc, om, on, pid_n, M, N, out_ptr, stride_om, ws_ptr, cnt_ptr, b_ptr, n_splits,
                     SPLIT, HAS_BIAS)


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
def _gemv_finish(acc, om, on, pid_n, M, N, out_ptr, stride_om, ws_ptr, cnt_ptr, b_ptr, n_splits,
                 SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The [M, N] tile ``acc`` (index grids ``om`` / ``on``) out: stored, or with split-K
    added into the workspace and stored by the program arriving last."""
    omask = (om < M) & (on < N)
    out_ptrs = out_ptr + om * stride_om + on
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
            _gemv_store(acc, b_ptr, out_ptrs, on, N, omask, HAS_BIAS)
    else:
        _gemv_store(acc, b_ptr, out_ptrs, on, N, omask, HAS_BIAS)


def _pick_split(n_tiles: int, K: int, block_k: int, sms: int) -> int:
    """Split K only when the n-tiles alone leave SMs idle; then aim at about 4x SMs programs."""
    if n_tiles >= sms:
        return 1
    return max(1, min(triton.cdiv(4 * sms, n_tiles), triton.cdiv(K, block_k)))


# prefer_gemv's size limits (weights, up to 2 rows), plain and with the SiLU-and-mul fused
# into the input: lower there, as every program recomputes the silu of its K range.
_MAX_WEIGHTS = 64 << 20
_SILU_MAX_WEIGHTS = 32 << 20
_SILU_EXP_BUDGET = 8 << 20  # silu evaluations per launch the FMA-path heuristic aims under


def prefer_gemv(M: int, N: int, K: int, silu_mul_input: bool = False) -> bool:
    """Whether the GEMV beats cuBLAS for this shape: up to 2 rows, up to ``_SILU_MAX_WEIGHTS``
    weights with the SiLU-and-mul fused in and ``_MAX_WEIGHTS`` without; more rows, up to 16M."""
    if M <= 2:
        return N * K <= (_SILU_MAX_WEIGHTS if silu_mul_input else _MAX_WEIGHTS)
    return N * K <= (16 << 20)


def gemv_config(M: int, N: int, K: int, dtype: torch.dtype, sms: int, config: Optional[dict] = None,
                silu_mul_input: bool = False) -> dict:
    """Launch parameters: the heuristic, overridden by the keys given in ``config`` (a config
    without SPLIT_K gets the heuristic split for its BLOCK_N / BLOCK_K)."""
    config = checked_config(config, _CONFIG_KEYS, "gemv")
    vec_k = 32 * 16 // dtype.itemsize  # a warp-wide row of 16-byte vectors: 256 bf16, 128 fp32
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
        # where that count gets large
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
    return {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "DOT": dot, "num_warps": warps,
            "num_stages": config.get("num_stages", 3 if dot else 2)}


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
    x = unit_stride(x)
    if bias is not None:
        assert bias.shape == (w.shape[0],)
        bias = bias.contiguous()
    if out is None:
        out = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    assert out.shape == (M, n_out) and out.stride(1) == 1
    return x, bias, out


def _launch(x, w, bias, out, ws, cnt, cfg: dict, grid: tuple, k_per_split: int, **flags) -> None:
    """One ``_gemv_kernel`` launch over operands checked by ``_launch_operands`` (out [M, N]; grid
    (n-tiles, splits)); ``flags``: SPLIT, SILU_MUL and GLU."""
    M, N, K = x.shape[0], out.shape[1], w.shape[1]
    pdl = pdl_enabled(x)
    _gemv_kernel[grid](
        x, w, bias if bias is not None else w, out, ws, cnt,
        M, N, K, x.stride(0), w.stride(0), out.stride(0), k_per_split, grid[1],
        M_PAD=next_pow2(M), BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], DOT=cfg["DOT"],  # (tl.dot pads small M)
        IEEE=x.dtype == torch.float32, HAS_BIAS=bias is not None, USE_PDL=pdl,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **flags, **pdl_launch_kwargs(pdl),
    )


def gemv_triton(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                silu_mul_input: bool = False, out: Optional[torch.Tensor] = None,
                config: Optional[dict] = None) -> torch.Tensor:
    """x [M, K] (or [M, 2K] gate|up with silu_mul_input), w [N, K] -> [M, N] in x.dtype; fp32
    accumulation. Split-K sums partials in arrival order: not bitwise reproducible run to run."""
    assert x.dim() == 2 and w.dim() == 2 and x.dtype == w.dtype, "x [M, K] and w [N, K] of one dtype"
    M, (N, K) = x.shape[0], w.shape
    assert x.shape[1] == (2 * K if silu_mul_input else K), "x width must be K (2K with silu_mul_input)"
    x, bias, out = _launch_operands(x, w, bias, out, N)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_(bias.expand(M, N) if bias is not None else torch.zeros_like(out))
    items = config or _env_config()
    cfg = _cached_config(M, N, K, x.dtype, device_sms(x), tuple(sorted(items.items())), silu_mul_input)
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    n_splits, n_tiles = cfg["SPLIT_K"], triton.cdiv(N, bn)
    k_per_split = triton.cdiv(triton.cdiv(K, bk), n_splits) * bk  # the last range may be ragged
    split = n_splits > 1
    ws = _zeros(x.device, torch.float32, next_pow2(M * N)) if split else out
    cnt = _zeros(x.device, torch.int32, next_pow2(n_tiles)) if split else out
    _launch(x, w, bias, out, ws, cnt, cfg, (n_tiles, n_splits), k_per_split, SPLIT=split, SILU_MUL=silu_mul_input)
    return out


def gemv_glu_triton(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                    out: Optional[torch.Tensor] = None, config: Optional[dict] = None) -> torch.Tensor:
    """``silu_and_mul(x @ w^T + bias)`` in one launch: w [2I, K] a packed gate_up (gate rows, then
    up rows), x [M, K] -> [M, I], rounded as gate_up's output, then as silu_and_mul. No split-K."""
    assert x.dim() == 2 and w.dim() == 2 and x.dtype == w.dtype, "x [M, K] and w [2I, K] of one dtype"
    M, (N2, K) = x.shape[0], w.shape
    assert N2 % 2 == 0 and x.shape[1] == K, "w must be [2I, K] and x [M, K]"
    N = N2 // 2
    x, bias, out = _launch_operands(x, w, bias, out, N)
    if M == 0 or N == 0 or K == 0:  # degenerate: the unfused way
        y = reference_linear(x, w, bias) if K else torch.zeros(M, N2, dtype=x.dtype, device=x.device)
        if K == 0 and bias is not None:
            y = bias.expand(M, N2).to(x.dtype)
        return out.copy_(reference_silu_and_mul(y))
    items = dict(config or _env_config())
    items["SPLIT_K"] = 1
    cfg = _cached_config(M, N2, K, x.dtype, device_sms(x), tuple(sorted(items.items())), False)
    bn = cfg["BLOCK_N"]
    assert bn >= 2, "a GLU tile holds gate and up rows: BLOCK_N >= 2"
    _launch(x, w, bias, out, out, out, cfg, (triton.cdiv(N, bn // 2), 1),
            triton.cdiv(K, cfg["BLOCK_K"]) * cfg["BLOCK_K"], SPLIT=False, SILU_MUL=False, GLU=True)
    return out


def glu_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``glu_linear`` takes this decode call on the GLU GEMV (1-2 rows, CUDA, half
    precision, a packed gate_up of even width)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return rows <= 2 and w.shape[0] % 2 == 0 and _gemv_ok(x, w, rows)


def glu_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu_and_mul(F.linear(x, w, bias))`` for a packed gate_up ``w`` [2I, K], x [..., K]:
    the GLU GEMV where ``glu_ok``, else the two ops."""
    if glu_ok(x, w):
        rows = x.numel() // x.shape[-1]
        y = gemv_glu_triton(x.reshape(rows, x.shape[-1]), w, bias)
        return y.view(*x.shape[:-1], w.shape[0] // 2)
    return silu_and_mul(F.linear(x, w, bias))


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
