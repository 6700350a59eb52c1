"""Mixture-of-experts ops, each a torch reference and a Triton path behind one public function:
router GEMM (fp32 logits), expert selection (softmax or sigmoid + bias, grouped top-k,
renormalise, scale), the norm + router launch and ``fused_moe`` (GEMMs in ``experts.py``).
x [T, H], router weight [E, H], topk weights / ids [T, K] fp32 / int32. ``shared_gate`` (the
routing ops): the router's row E (the logits' column E) is the gate of a shared expert stacked as
expert E, which every token gets as entry K, weighted sigmoid(logit E). Knows no models.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from .._common import (checked_config, device_sms, next_pow2, pdl_enabled, pdl_launch_dependents, pdl_launch_kwargs,
                      pdl_wait, tl, triton, unit_stride, use_triton)
from ..fp8_weights import dequantize
from .experts import fused_moe_triton
from .routing import _select_row, check_routing
from ..norm.rmsnorm import fused_add_rms_norm, rms_normalize


def reference_router_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Router logits in fp32: [T, H] x [E, H]^T -> [T, E] (inputs widened, fp32 accumulate)."""
    return x.float() @ weight.float().t()


def reference_select_experts(logits: torch.Tensor, top_k: int, scoring: str = "softmax",
                             bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
                             renormalize: bool = True, scaling: float = 1.0, shared_gate: bool = False):
    """logits [T, E] (fp32) -> (weights [T, K] fp32, ids [T, K] int32). ``scoring``: "softmax" or
    "sigmoid"; ``bias`` (e_score_correction_bias) shifts the scores for selection only. With
    n_group > 1 a group scores the sum of its top-2 biased scores (its max without a bias) and
    only the best topk_group groups are eligible. ``renormalize`` divides the K weights by their
    sum; ``scaling`` (routed_scaling_factor) multiplies them. ``shared_gate``: logits [T, E + 1],
    then [T, K + 1], the last entry expert E with weight sigmoid(logits[:, E])."""
    if shared_gate:
        e = logits.shape[-1] - 1
        weights, ids = reference_select_experts(logits[:, :e], top_k, scoring, bias, n_group, topk_group,
                                                renormalize, scaling)
        return (torch.cat([weights, torch.sigmoid(logits[:, e:].float())], 1),
                torch.cat([ids, torch.full_like(ids[:, :1], e)], 1))
    if scoring == "softmax":
        scores = torch.softmax(logits.float(), dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits.float())
    else:
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    choice = scores + bias.float() if bias is not None else scores
    if n_group > 1:
        T, E = choice.shape
        groups = choice.view(T, n_group, E // n_group)
        if bias is not None:
            gscore = groups.topk(2, dim=-1).values.sum(-1)
        else:
            gscore = groups.max(dim=-1).values
        keep = gscore.topk(topk_group, dim=-1).indices
        gmask = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~gmask.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if scaling != 1.0:
        weights = weights * scaling
    return weights, ids.to(torch.int32)


def reference_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor, dropped_ids: bool = False,
                        fp32_sum: bool = False, scales: Optional[tuple] = None) -> torch.Tensor:
    """sum_k weight[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, k]; [T, H] in x's
    dtype: each expert's output rounded to x's dtype (as transformers), the sum in fp32 (returned
    unrounded with ``fp32_sum``). ``dropped_ids``: ids -1 contribute nothing. ``scales``: (w13's,
    w2's fp32 block scales, block) of float8 experts, dequantized to x's dtype first."""
    T, H = x.shape
    inter = w2.shape[2]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    for e in torch.unique(flat_ids).tolist():
        if e < 0 and dropped_ids:
            continue
        rows = (flat_ids == e).nonzero().squeeze(1)
        tok = rows // topk_ids.shape[1]
        w_up, w_down = w13[e], w2[e]
        if scales is not None:
            w_up = dequantize(w_up, scales[0][e], scales[2], x.dtype)
            w_down = dequantize(w_down, scales[1][e], scales[2], x.dtype)
        h = x[tok] @ w_up.t()
        a = (F.silu(h[:, :inter].float()).to(x.dtype) * h[:, inter:])
        y = (a @ w_down.t()).to(x.dtype)
        out.index_add_(0, tok, y.float() * topk_weights.reshape(-1)[rows, None].float())
    return out if fp32_sum else out.to(x.dtype)


# ---- router GEMM ----------------------------------------------------------------------

ROUTER_CONFIG_KEYS = ("BLOCK_T", "BLOCK_E", "BLOCK_H", "SPLIT_H", "DOT", "num_warps", "num_stages")


@triton.jit
def _router_acc(acc, a, w, DOT: tl.constexpr, WIDEN: tl.constexpr):
    if DOT:  # a [BT, BH], w [BE, BH], acc [BT, BE]
        if WIDEN:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    else:  # a [BT, BE, BH] (broadcast over E), acc [BT, BE, BH]
        acc += a.to(tl.float32) * w.to(tl.float32)[None, :, :]
    return acc


@triton.jit
def _router_gemm_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, T, E, H, stride_xt, stride_we, stride_ot,
                        h_per_split, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                        SPLIT: tl.constexpr, DOT: tl.constexpr, WIDEN: tl.constexpr, USE_PDL: tl.constexpr):
    pid_e, pid_s, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    kk = tl.arange(0, BLOCK_H)
    h0 = pid_s * h_per_split  # this split's H range: [h0, h0 + h_per_split), BLOCK_H-aligned
    h_left = H - h0
    w_ptrs = w_ptr + offs_e.to(tl.int64)[:, None] * stride_we + h0 + kk[None, :]  # [BE, BH]
    w_rows = offs_e[:, None] < E
    x_rows = x_ptr + offs_t.to(tl.int64) * stride_xt + h0
    if DOT:
        x_ptrs = x_rows[:, None] + kk[None, :]
        x_ok = offs_t[:, None] < T
        x_k = kk[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    else:  # x pointers broadcast over E: the x tile lands in the product's register layout
        x_ptrs = tl.broadcast_to(x_rows[:, None, None] + kk[None, None, :], (BLOCK_T, BLOCK_E, BLOCK_H))
        x_ok = offs_t[:, None, None] < T
        x_k = kk[None, None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_E, BLOCK_H], dtype=tl.float32)
    # the weight does not depend on the kernel before: its first tile loads while that one ends
    w = tl.load(w_ptrs, mask=w_rows & (kk[None, :] < h_left), other=0.0, eviction_policy="evict_first")
    pdl_wait(USE_PDL)
    for k in range(0, h_per_split, BLOCK_H):
        a = tl.load(x_ptrs + k, mask=x_ok & (x_k < h_left - k), other=0.0)
        acc = _router_acc(acc, a, w, DOT, WIDEN)
        nxt = k + BLOCK_H  # the next tile loads before this one is consumed (a masked no-op at the end)
        w = tl.load(w_ptrs + nxt, mask=w_rows & (kk[None, :] < h_left - nxt) & (nxt < h_per_split),
                    other=0.0, eviction_policy="evict_first")
    pdl_launch_dependents(USE_PDL)
    if not DOT:
        acc = tl.sum(acc, axis=2)
    om, on = offs_t[:, None], offs_e[None, :]
    omask = (om < T) & (on < E)
    out_ptrs = out_ptr + om.to(tl.int64) * stride_ot + on
    if SPLIT == 1:
        tl.store(out_ptrs, acc, mask=omask)
    else:  # partials in ws [SPLIT, T, E]; the tile's last split to arrive sums them in order
        ws_ptrs = ws_ptr + om * E + on
        tl.store(ws_ptrs + pid_s * T * E, acc, mask=omask)
        tl.debug_barrier()  # every thread's partial is stored before the release below
        tile = pid_t * tl.num_programs(0) + pid_e
        if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:
            total = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                total += tl.load(ws_ptrs + s * T * E, mask=omask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total, mask=omask)
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch


def router_config(T: int, E: int, H: int, x_dtype: torch.dtype, w_dtype: torch.dtype, sms: int,
                  config: Optional[dict] = None) -> dict:
    """Launch parameters: the heuristic (docs/gpu-performance.md), overridden by the keys given in
    ``config``."""
    config = checked_config(config, ROUTER_CONFIG_KEYS, "router")
    dot = bool(config.get("DOT", T > 2))
    wide = x_dtype == torch.float32 or x_dtype != w_dtype
    warp_row = 32 * 16 // w_dtype.itemsize  # a warp's row of 16-byte vectors: 256 bf16, 128 fp32
    if not dot:
        bt, be, bh, warps = next_pow2(T), 4, 2 * warp_row, 4
    elif T <= 16:
        bt, be, bh, warps = next_pow2(T), 16, warp_row, 4
    else:
        bt, be, bh, warps = 64, min(64, max(16, next_pow2(E))), 32 if wide else 64, 4
    bt, be = config.get("BLOCK_T", bt), config.get("BLOCK_E", be)
    tiles = triton.cdiv(E, be) * triton.cdiv(T, bt)
    bh = min(bh, max(16, next_pow2(H)))
    while tiles * triton.cdiv(H, bh) < sms and bh > 64:  # short H: narrower chunks to split over
        bh //= 2
    bh = config.get("BLOCK_H", bh)
    chunks = triton.cdiv(H, bh)
    split = config.get("SPLIT_H") or (1 if tiles >= sms else min(chunks, triton.cdiv(2 * sms, tiles), 32))
    split = triton.cdiv(chunks, triton.cdiv(chunks, split))  # no empty ranges
    return {"BLOCK_T": bt, "BLOCK_E": be, "BLOCK_H": bh, "SPLIT_H": split, "DOT": dot,
            "num_warps": config.get("num_warps", warps), "num_stages": config.get("num_stages", 3 if dot else 2)}


@functools.lru_cache(maxsize=1024)
def _router_config_cached(T, E, H, x_dtype, w_dtype, sms, items):
    return router_config(T, E, H, x_dtype, w_dtype, sms, dict(items))


@functools.lru_cache(maxsize=None)
def _zeros(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """Cached split-H workspace / arrival counters (power-of-two sizes; counters stay 0
    between launches). Shared by the calls on one device: one stream at a time."""
    return torch.zeros(numel, dtype=dtype, device=device)


def router_gemm_triton(x: torch.Tensor, weight: torch.Tensor, *, config: Optional[dict] = None) -> torch.Tensor:
    """x [T, H] (bf16 / fp16 / fp32) @ weight [E, H]^T -> fp32 logits [T, E], fp32 accumulate."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], "x [T, H] and weight [E, H]"
    T, H = x.shape
    E = weight.shape[0]
    x, weight = unit_stride(x), unit_stride(weight)
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    if T == 0 or E == 0:
        return out
    if H == 0:
        return out.zero_()
    cfg = _router_config_cached(T, E, H, x.dtype, weight.dtype, device_sms(x),
                                tuple(sorted((config or {}).items())))
    bh, split = cfg["BLOCK_H"], cfg["SPLIT_H"]
    grid = (triton.cdiv(E, cfg["BLOCK_E"]), split, triton.cdiv(T, cfg["BLOCK_T"]))
    ws = _zeros(x.device, torch.float32, next_pow2(split * T * E)) if split > 1 else out
    cnt = _zeros(x.device, torch.int32, next_pow2(grid[0] * grid[2])) if split > 1 else out
    pdl = pdl_enabled(x)
    _router_gemm_kernel[grid](
        x, weight, out, ws, cnt, T, E, H, x.stride(0), weight.stride(0), out.stride(0),
        triton.cdiv(triton.cdiv(H, bh), split) * bh,
        BLOCK_T=cfg["BLOCK_T"], BLOCK_E=cfg["BLOCK_E"], BLOCK_H=bh, SPLIT=split, DOT=cfg["DOT"],
        WIDEN=x.dtype == torch.float32 or x.dtype != weight.dtype, USE_PDL=pdl,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch_kwargs(pdl))
    return out


# ---- expert selection -----------------------------------------------------------------

@triton.jit
def _select_experts_kernel(logits_ptr, bias_ptr, w_out_ptr, id_out_ptr, stride_l, scaling,
                           GROUP: tl.constexpr, N_GROUP: tl.constexpr, NG_PAD: tl.constexpr,
                           G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                           K_PAD: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                           RENORM: tl.constexpr, SHARED_GATE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    pdl_launch_dependents(USE_PDL)
    _select_row(logits_ptr + row * stride_l, bias_ptr, w_out_ptr, id_out_ptr, row, scaling, GROUP, N_GROUP,
                NG_PAD, G_PAD, TOPK_GROUP, TOP_K, K_PAD, SIGMOID, HAS_BIAS, RENORM, SHARED_GATE)


def select_experts_triton(logits: torch.Tensor, top_k: int, scoring: str = "softmax",
                          bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
                          renormalize: bool = True, scaling: float = 1.0, shared_gate: bool = False):
    """``reference_select_experts`` in one kernel: (weights [T, K] fp32, ids [T, K] int32), K + 1
    columns with ``shared_gate``."""
    T, E = logits.shape[0], logits.shape[1] - shared_gate
    check_routing(E, top_k, scoring, bias, n_group, topk_group)
    logits = unit_stride(logits.float())
    out_k = top_k + shared_gate
    weights = torch.empty(T, out_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, out_k, dtype=torch.int32, device=logits.device)
    if T == 0:
        return weights, ids
    group = E // n_group
    ng_pad, g_pad = next_pow2(n_group), next_pow2(group)
    pdl = pdl_enabled(logits)
    _select_experts_kernel[(T,)](
        logits, bias.contiguous() if bias is not None else logits, weights, ids, logits.stride(0), float(scaling),
        GROUP=group, N_GROUP=n_group, NG_PAD=ng_pad, G_PAD=g_pad, TOPK_GROUP=topk_group if n_group > 1 else 1,
        TOP_K=top_k, K_PAD=next_pow2(top_k), SIGMOID=scoring == "sigmoid", HAS_BIAS=bias is not None,
        RENORM=bool(renormalize), SHARED_GATE=bool(shared_gate), USE_PDL=pdl,
        num_warps=1 if ng_pad * g_pad <= 512 else 4, **pdl_launch_kwargs(pdl))
    return weights, ids


# ---- post-attention residual add + RMSNorm + router GEMM in one launch (decode) -----------

@triton.jit
def _norm_route_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, h_ptr, ro_ptr, logit_ptr,
                       T, E, H, stride_x, stride_r, stride_h, stride_ro, stride_we, eps,
                       BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """Program p: router rows [p*BLOCK_E, +BLOCK_E). Every program forms each token's x + residual
    and its RMSNorm itself (program 0 stores them), multiplies its router rows (loaded before the
    PDL wait) and stores those logits; then its dependents (the selection launch) may start."""
    pid = tl.program_id(0)
    offs_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    cols = tl.arange(0, BLOCK_H)
    hmask = cols < H
    e_ok = offs_e < E
    w = tl.load(w_ptr + offs_e.to(tl.int64)[:, None] * stride_we + cols[None, :],
                mask=e_ok[:, None] & hmask[None, :], other=0.0)
    nw = tl.load(nw_ptr + cols, mask=hmask, other=0.0)
    pdl_wait(USE_PDL)
    for t in range(T):
        x = tl.load(x_ptr + t * stride_x + cols, mask=hmask, other=0.0)
        if HAS_RESIDUAL:  # the rounding steps of kernels/norm/rmsnorm.py's fused add + norm
            r = tl.load(r_ptr + t * stride_r + cols, mask=hmask, other=0.0)
            x = x.to(r.dtype)  # (an fp32 sum beside the residual: rounded first, as the reference's output)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            if pid == 0:
                tl.store(ro_ptr + t * stride_ro + cols, x, mask=hmask)
        h = (rms_normalize(x, H, eps).to(tl.float32) * nw.to(tl.float32)).to(h_ptr.dtype.element_ty)
        if pid == 0:
            tl.store(h_ptr + t * stride_h + cols, h, mask=hmask)
        logit = tl.sum(h.to(tl.float32)[None, :] * w.to(tl.float32), axis=1)
        tl.store(logit_ptr + t * E + offs_e, logit, mask=e_ok)
    pdl_launch_dependents(USE_PDL)


NORM_ROUTE_MAX_T = 4  # tokens per launch: each program loops over them


def norm_route_experts_triton(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor,
                              eps: float, weight: torch.Tensor, top_k: int, scoring: str = "softmax",
                              bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
                              renormalize: bool = True, scaling: float = 1.0, shared_gate: bool = False):
    """``reference_norm_route_experts`` in two launches for up to NORM_ROUTE_MAX_T tokens: the
    residual add, the RMSNorm and the router GEMM in one (``_norm_route_kernel``), the selection
    (``select_experts_triton``) in the next."""
    T, H = x.shape
    E = weight.shape[0]  # (the logits of every router row, a shared gate row included)
    check_routing(E - shared_gate, top_k, scoring, bias, n_group, topk_group)
    assert 0 < T <= NORM_ROUTE_MAX_T and weight.shape[1] == H and norm_weight.shape == (H,)
    x, weight = unit_stride(x), unit_stride(weight)
    if residual is not None:
        residual = unit_stride(residual)
    h = torch.empty_like(x if residual is None else residual)  # (x may be an fp32 sum: see rmsnorm.fused_add_rms_norm)
    res_out = torch.empty_like(residual) if residual is not None else x
    logits = torch.empty(T, E, dtype=torch.float32, device=x.device)
    block_h = next_pow2(H)
    block_e = min(next_pow2(E), next_pow2(triton.cdiv(E, device_sms(x))))  # about a program per SM or more
    pdl = pdl_enabled(x)
    r = residual if residual is not None else x
    grid = triton.cdiv(E, block_e)
    warps = 4 if block_h <= 2048 else 8
    _norm_route_kernel[(grid,)](
        x, r, norm_weight, weight, h, res_out, logits,
        T, E, H, x.stride(0), r.stride(0), h.stride(0), res_out.stride(0), weight.stride(0), float(eps),
        BLOCK_E=block_e, BLOCK_H=block_h, HAS_RESIDUAL=residual is not None, USE_PDL=pdl,
        num_warps=warps, **pdl_launch_kwargs(pdl))
    weights, ids = select_experts_triton(logits, top_k, scoring, bias, n_group, topk_group, renormalize, scaling,
                                         shared_gate)
    return h, res_out, weights, ids


def reference_norm_route_experts(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor,
                                 eps: float, weight: torch.Tensor, top_k: int, scoring: str = "softmax",
                                 bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
                                 renormalize: bool = True, scaling: float = 1.0, shared_gate: bool = False):
    """The post-attention half's routing: (h = rms_norm(x + residual), x + residual, topk
    weights, topk ids) with h routed by ``route_experts`` (the norm and routing dispatchers).
    residual None: h = rms_norm(x) and x is returned as the residual."""
    h, res = fused_add_rms_norm(x, residual, norm_weight, eps)
    return (h, res, *route_experts(h, weight, top_k, scoring, bias, n_group, topk_group, renormalize, scaling,
                                   shared_gate))


# ---- public ops -----------------------------------------------------------------------

ROUTER_TRITON_MAX_T = 64  # beyond: cuBLAS with an fp32 output (where torch has mm(out_dtype=))


@functools.lru_cache(maxsize=None)
def _mm_out_dtype() -> bool:
    return hasattr(torch.ops.aten.mm, "dtype")


def router_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 router logits [T, E] of x [T, H]: the Triton GEMM for CUDA tensors (prefill-sized
    half-precision batches: cuBLAS writing fp32), torch otherwise."""
    if not use_triton(x):
        return reference_router_gemm(x, weight)
    if (x.shape[0] > ROUTER_TRITON_MAX_T and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and _mm_out_dtype()):
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return router_gemm_triton(x, weight)


def select_experts(logits: torch.Tensor, top_k: int, scoring: str = "softmax",
                   bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
                   renormalize: bool = True, scaling: float = 1.0, shared_gate: bool = False):
    """(weights [T, K] fp32, ids [T, K] int32) of the experts each token goes to; see
    ``reference_select_experts``. One Triton kernel for CUDA tensors, torch otherwise."""
    check_routing(logits.shape[-1] - shared_gate, top_k, scoring, bias, n_group, topk_group)
    fn = select_experts_triton if use_triton(logits) else reference_select_experts
    return fn(logits, top_k, scoring, bias, n_group, topk_group, renormalize, scaling, shared_gate)


def route_experts(x: torch.Tensor, weight: torch.Tensor, top_k: int, scoring: str = "softmax",
                  bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
                  renormalize: bool = True, scaling: float = 1.0, shared_gate: bool = False):
    """``select_experts(router_gemm(x, weight), ...)``: (weights [T, K] fp32, ids [T, K] int32),
    two launches on CUDA."""
    return select_experts(router_gemm(x, weight), top_k, scoring, bias, n_group, topk_group, renormalize, scaling,
                          shared_gate)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, dropped_ids: bool = False, fp32_sum: bool = False,
              scales: Optional[tuple] = None) -> torch.Tensor:
    """``reference_fused_moe``'s result: grouped GEMMs in Triton for CUDA tensors, torch otherwise.
    ``dropped_ids``, ``fp32_sum`` (the torch path then always returns the fp32 sum) and
    ``scales`` as there."""
    fn = fused_moe_triton if use_triton(x) else reference_fused_moe
    return fn(x, w13, w2, topk_weights, topk_ids, dropped_ids=dropped_ids, fp32_sum=fp32_sum, scales=scales)


# MoE decode layers of up to NORM_ROUTE_MAX_T tokens run the residual add + RMSNorm and the
# router GEMM in one launch and the selection in its own next one; larger batches and CPU
# tensors take the three ops apart.


def norm_route_ok(x: torch.Tensor) -> bool:
    """Whether ``norm_route_experts`` takes the Triton norm + router launch for x [T, H]."""
    return x.dim() == 2 and use_triton(x) and 0 < x.shape[0] <= NORM_ROUTE_MAX_T


def norm_route_experts(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, top_k: int, scoring: str = "softmax",
                       bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
                       renormalize: bool = True, scaling: float = 1.0, shared_gate: bool = False):
    """(rms_norm(x + residual), x + residual, topk weights [T, K] fp32, topk ids [T, K] int32):
    where ``norm_route_ok(x)`` the norm and the router GEMM in one Triton launch and the
    selection in another, else the norm and ``route_experts``."""
    fn = norm_route_experts_triton if norm_route_ok(x) else reference_norm_route_experts
    return fn(x, residual, norm_weight, eps, weight, top_k, scoring, bias, n_group, topk_group, renormalize, scaling,
              shared_gate)
