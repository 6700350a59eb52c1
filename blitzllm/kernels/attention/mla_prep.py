"""Fused MLA attention prologue in one launch: latent RMSNorm + rotary on the rope parts +
latent-cache write (program (t, 0)) and the query heads' rotary (programs (t, 1 + j)),
instead of a dozen torch ops per layer; numerics as ``MLAttention``'s torch steps
(docs/gpu-performance.md#mla).
"""
import torch

from .._common import next_pow2, tl, triton
from .kv_store import copy_rows, store_cast

HEADS_PER_PROG = 16


@triton.jit
def _rotate(src, cs, offs, hmask, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """src: pointers to the rope dims of one or more rows ([rows, 1] + offs [1, HALF_PAD]).
    Returns the fp32 (first, second) halves of the rotated rows."""
    if INTERLEAVE:
        a = tl.load(src + 2 * offs, mask=hmask, other=0.0).to(tl.float32)
        b = tl.load(src + 2 * offs + 1, mask=hmask, other=0.0).to(tl.float32)
    else:
        a = tl.load(src + offs, mask=hmask, other=0.0).to(tl.float32)
        b = tl.load(src + HALF + offs, mask=hmask, other=0.0).to(tl.float32)
    cmask = offs < HALF
    cos = tl.load(cs + offs, mask=cmask, other=1.0)
    sin = tl.load(cs + HALF + offs, mask=cmask, other=0.0)
    return a * cos - b * sin, b * cos + a * sin


@triton.jit
def _mla_prep_kernel(
    q_ptr, kv_ptr, pos_ptr, cs_ptr, nw_ptr, slot_ptr, cache_ptr, qpe_ptr,
    stride_qt, stride_qh, stride_kvt, stride_cs, stride_cache_slot, stride_qpe_t,
    H, eps,
    R: tl.constexpr, R_PAD: tl.constexpr, N: tl.constexpr, P: tl.constexpr, HALF_PAD: tl.constexpr,
    HB: tl.constexpr, INTERLEAVE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    HALF: tl.constexpr = P // 2
    cs = cs_ptr + tl.load(pos_ptr + t) * stride_cs
    offs_p = tl.arange(0, HALF_PAD)
    pmask = offs_p < HALF
    if part == 0:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            row = kv_ptr + t * stride_kvt
            offs_r = tl.arange(0, R_PAD)
            rmask = offs_r < R
            x = tl.load(row + offs_r, mask=rmask, other=0.0)
            xf = x.to(tl.float32)
            normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / R + eps)).to(x.dtype)
            w = tl.load(nw_ptr + offs_r, mask=rmask, other=0.0).to(tl.float32)
            dst = cache_ptr + slot * stride_cache_slot
            tl.store(dst + offs_r, store_cast((w * normed.to(tl.float32)).to(x.dtype), cache_ptr), mask=rmask)
            first, second = _rotate(row + R, cs, offs_p, pmask, HALF, INTERLEAVE)
            tl.store(dst + R + offs_p, store_cast(first.to(x.dtype), cache_ptr), mask=pmask)
            tl.store(dst + R + HALF + offs_p, store_cast(second.to(x.dtype), cache_ptr), mask=pmask)
    else:
        offs_h = (part - 1) * HB + tl.arange(0, HB)
        hmask = (offs_h < H)[:, None] & pmask[None, :]
        src = q_ptr + t * stride_qt + offs_h[:, None].to(tl.int64) * stride_qh + N
        first, second = _rotate(src, cs, offs_p[None, :], hmask, HALF, INTERLEAVE)
        dst = qpe_ptr + t * stride_qpe_t + offs_h[:, None] * P + offs_p[None, :]
        tl.store(dst, first.to(qpe_ptr.dtype.element_ty), mask=hmask)
        tl.store(dst + HALF, second.to(qpe_ptr.dtype.element_ty), mask=hmask)


def mla_prep_triton(q, kv_a, positions, cos_sin_cache, norm_weight, eps, cache, slot_mapping,
                    nope_dim: int, interleave: bool = True):
    """q [T, H, N + P] (any strides with unit stride inside a head), kv_a [T, R + P] (rows
    may be a strided view); writes [rms_norm(kv_a[:, :R]), rope(kv_a[:, R:])] into
    cache [NB, BS, 1, R + P] at slot_mapping (negative: skipped) and returns the rotated
    q_pe [T, H, P] (contiguous)."""
    T, H, qk = q.shape
    P = qk - nope_dim
    R = kv_a.shape[1] - P
    assert P % 2 == 0 and cos_sin_cache.shape[-1] == P and cos_sin_cache.stride(-1) == 1
    assert q.stride(2) == 1 and kv_a.stride(1) == 1 and norm_weight.numel() == R
    assert cache.shape[-1] == R + P and cache.shape[-2] == 1 and cache.stride(-1) == 1
    q_pe = torch.empty((T, H, P), dtype=q.dtype, device=q.device)
    if T == 0:
        return q_pe
    slot_stride = cache.stride(1)
    assert cache.stride(0) == cache.shape[1] * slot_stride, "cache blocks must be contiguous"
    _mla_prep_kernel[(T, 1 + triton.cdiv(H, HEADS_PER_PROG))](
        q, kv_a, positions, cos_sin_cache, norm_weight, slot_mapping, cache, q_pe,
        q.stride(0), q.stride(1), kv_a.stride(0), cos_sin_cache.stride(0), slot_stride, q_pe.stride(0),
        H, float(eps),
        R=R, R_PAD=next_pow2(R), N=nope_dim, P=P, HALF_PAD=next_pow2(P // 2), HB=HEADS_PER_PROG,
        INTERLEAVE=bool(interleave), num_warps=4,
    )
    return q_pe


def reference_mla_prep(q, kv_a, positions, cos_sin_cache, norm_weight, eps, cache, slot_mapping,
                       nope_dim: int, interleave: bool = True):
    """The same in torch (``MLAttention``'s unfused steps)."""
    from ..norm.rmsnorm import reference_rms_norm
    T, H, qk = q.shape
    P = qk - nope_dim
    R = kv_a.shape[1] - P
    latent = reference_rms_norm(kv_a[:, :R], norm_weight, eps)
    x = torch.cat([q[..., nope_dim:], kv_a[:, None, R:]], 1)  # [T, H + 1, P]
    if interleave:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], -1)
    cs = cos_sin_cache.index_select(0, positions.long()).float()
    c, s = cs[:, None, :P // 2], cs[:, None, P // 2:]
    xf = x.float()
    a, b = xf[..., :P // 2], xf[..., P // 2:]
    rot = torch.cat([a * c - b * s, b * c + a * s], -1).to(q.dtype)
    keep = slot_mapping >= 0
    entry = torch.cat([latent, rot[:, -1]], -1)[keep]
    copy_rows(cache.view(-1, R + P), slot_mapping[keep].long(), entry)
    return rot[:, :-1].contiguous()
