"""Fused q/k RMSNorm (per head, or ``full_width_norm`` over all heads) + neox rotary + paged
KV-cache write in one launch: program (t, 0) token t's q heads, (t, 1) its k heads, (t, 2) its
v heads (slots < 0 not written). Numerics as ``reference_qk_norm_rope_cache``: HF-style norm,
rotation in fp32 with the fp32 cos/sin cache, rounded once.
"""
from typing import Optional

import torch

from .._common import next_pow2, tl, triton, unit_stride, use_triton
from ..norm.rmsnorm import reference_rms_norm
from .kv_store import store_cast, to_cache


@triton.jit
def _norm_rope_params(
    w_ptr, cs_ptr, heads,
    HAS_NORM: tl.constexpr, FULL_NORM: tl.constexpr, H_PAD: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, ROT: tl.constexpr,
):
    """What ``_norm_rope_apply`` needs besides the heads, independent of their values (so loadable
    before the PDL wait): fp32 norm weights at each dim and its rotary partner ([D_PAD], or
    [H_PAD, D_PAD] with FULL_NORM; ones without norm) and cos / sin [D_PAD] of the row at cs_ptr."""
    HALF: tl.constexpr = ROT // 2
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    in_rot = offs_d < ROT
    first = offs_d < HALF
    partner = tl.where(in_rot, tl.where(first, offs_d + HALF, offs_d - HALF), offs_d)
    if HAS_NORM and FULL_NORM:
        mask = (offs_h < heads)[:, None] & (offs_d[None, :] < D)
        pmask = (offs_h < heads)[:, None] & in_rot[None, :]
        w = tl.load(w_ptr + offs_h[:, None] * D + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + offs_h[:, None] * D + partner[None, :], mask=pmask, other=0.0).to(tl.float32)
    elif HAS_NORM:
        w = tl.load(w_ptr + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=in_rot, other=0.0).to(tl.float32)
    else:
        w = tl.full([D_PAD], 1.0, dtype=tl.float32)
        wp = w
    cs_idx = tl.where(first, offs_d, offs_d - HALF)
    cos = tl.load(cs_ptr + cs_idx, mask=in_rot, other=1.0)
    sin = tl.load(cs_ptr + HALF + cs_idx, mask=in_rot, other=0.0)
    return w, wp, cos, sin


@triton.jit
def _norm_rope_apply(
    src_ptr, w, wp, cos, sin, heads, eps,
    HAS_NORM: tl.constexpr, FULL_NORM: tl.constexpr, H_PAD: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, ROT: tl.constexpr,
):
    """Load ``heads`` rows of D contiguous values at src_ptr, norm + rotate them with the
    ``_norm_rope_params``. Returns an fp32 [H_PAD, D_PAD] tile (rows >= heads are zeros).
    FULL_NORM: one rstd over all heads*D values, weights indexed by head*D + d."""
    HALF: tl.constexpr = ROT // 2
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    hmask = offs_h < heads
    mask = hmask[:, None] & (offs_d[None, :] < D)
    # partner of dim d inside the rotated part: d + HALF (first half), d - HALF (second)
    in_rot = offs_d < ROT
    first = offs_d < HALF
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    partner = tl.where(in_rot, partner, offs_d)
    pmask = hmask[:, None] & in_rot[None, :]
    base = src_ptr + offs_h[:, None] * D
    x = tl.load(base + offs_d[None, :], mask=mask, other=0.0)
    xp = tl.load(base + partner[None, :], mask=pmask, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    xpf = xp.to(tl.float32)
    if HAS_NORM:
        if FULL_NORM:
            rstd = tl.rsqrt(tl.sum(tl.sum(xf * xf, axis=1), axis=0) / (heads * D) + eps)
            xf = (xf * rstd).to(dtype).to(tl.float32) * w
            xpf = (xpf * rstd).to(dtype).to(tl.float32) * wp
        else:
            rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
            xf = (xf * rstd[:, None]).to(dtype).to(tl.float32) * w[None, :]
            xpf = (xpf * rstd[:, None]).to(dtype).to(tl.float32) * wp[None, :]
        xf = xf.to(dtype).to(tl.float32)
        xpf = xpf.to(dtype).to(tl.float32)
    sign = tl.where(first, -1.0, 1.0)
    return xf * cos[None, :] + sign[None, :] * xpf * sin[None, :]


@triton.jit
def _norm_rope_heads(
    src_ptr, w_ptr, cs_ptr, heads, eps,
    HAS_NORM: tl.constexpr, FULL_NORM: tl.constexpr, H_PAD: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, ROT: tl.constexpr,
):
    """``_norm_rope_apply`` with its ``_norm_rope_params`` loaded here."""
    w, wp, cos, sin = _norm_rope_params(w_ptr, cs_ptr, heads, HAS_NORM, FULL_NORM, H_PAD, D, D_PAD, ROT)
    return _norm_rope_apply(src_ptr, w, wp, cos, sin, heads, eps, HAS_NORM, FULL_NORM, H_PAD, D, D_PAD, ROT)


@triton.jit
def _qk_norm_rope_cache_kernel(
    qkv_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr,
    q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qkv, stride_cs, stride_qo_t,
    stride_cb, stride_ct, stride_vb, stride_vt,
    Hq, Hkv, eps,
    BLOCK_SIZE: tl.constexpr, HAS_NORM: tl.constexpr, FULL_NORM: tl.constexpr,
    HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, ROT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    row_ptr = qkv_ptr + t * stride_qkv
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < D
    if part == 0:
        pos = tl.load(pos_ptr + t)
        q = _norm_rope_heads(row_ptr, qw_ptr, cs_ptr + pos * stride_cs, Hq, eps,
                             HAS_NORM, FULL_NORM, HQ_PAD, D, D_PAD, ROT)
        offs_h = tl.arange(0, HQ_PAD)
        ptrs = q_out_ptr + t * stride_qo_t + offs_h[:, None] * D + offs_d[None, :]
        tl.store(ptrs, q.to(q_out_ptr.dtype.element_ty),
                 mask=(offs_h[:, None] < Hq) & dmask[None, :])
    else:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            offs_h = tl.arange(0, HKV_PAD)
            mask = (offs_h[:, None] < Hkv) & dmask[None, :]
            if part == 1:
                pos = tl.load(pos_ptr + t)
                k = _norm_rope_heads(row_ptr + Hq * D, kw_ptr, cs_ptr + pos * stride_cs, Hkv,
                                     eps, HAS_NORM, FULL_NORM, HKV_PAD, D, D_PAD, ROT)
                dst = k_cache_ptr + blk * stride_cb + off * stride_ct
                tl.store(dst + offs_h[:, None] * D + offs_d[None, :],
                         store_cast(k.to(qkv_ptr.dtype.element_ty), k_cache_ptr), mask=mask)
            else:
                src = row_ptr + (Hq + Hkv) * D
                v = tl.load(src + offs_h[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
                dst = v_cache_ptr + blk * stride_vb + off * stride_vt
                tl.store(dst + offs_h[:, None] * D + offs_d[None, :],
                         store_cast(v, v_cache_ptr), mask=mask)


def _check(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, rotary_dim,
           q_norm_weight=None, k_norm_weight=None, full_width_norm=False):
    if q_norm_weight is not None:
        wide = (num_heads * head_dim, num_kv_heads * head_dim) if full_width_norm else (head_dim, head_dim)
        assert (q_norm_weight.numel(), k_norm_weight.numel()) == wide, (q_norm_weight.shape, k_norm_weight.shape)
    rot = head_dim if rotary_dim is None else int(rotary_dim)
    assert rot % 2 == 0 and 0 < rot <= head_dim
    assert qkv.shape[-1] == (num_heads + 2 * num_kv_heads) * head_dim
    for c in (k_cache, v_cache):
        assert c.shape[2:] == (num_kv_heads, head_dim), c.shape
        assert c.stride(3) == 1 and c.stride(2) == head_dim, "cache head/dim must be contiguous"
    return rot


def fused_qk_norm_rope_cache_triton(
    qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim,
    k_cache, v_cache, slot_mapping,
    q_norm_weight=None, k_norm_weight=None, eps=1e-6, rotary_dim=None, full_width_norm=False,
):
    rot = _check(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, rotary_dim,
                 q_norm_weight, k_norm_weight, full_width_norm)
    assert cos_sin_cache.shape[-1] == rot and cos_sin_cache.stride(-1) == 1
    assert (q_norm_weight is None) == (k_norm_weight is None)
    qkv = unit_stride(qkv)
    T = qkv.shape[0]
    q = torch.empty((T, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    has_norm = q_norm_weight is not None
    qw = q_norm_weight if has_norm else qkv
    kw = k_norm_weight if has_norm else qkv
    d_pad = next_pow2(head_dim)
    hq_pad = next_pow2(num_heads)
    _qk_norm_rope_cache_kernel[(T, 3)](
        qkv, positions, cos_sin_cache, qw, kw,
        q, k_cache, v_cache, slot_mapping,
        qkv.stride(0), cos_sin_cache.stride(0), q.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        num_heads, num_kv_heads, float(eps),
        BLOCK_SIZE=k_cache.shape[1], HAS_NORM=has_norm, FULL_NORM=bool(full_width_norm),
        HQ_PAD=hq_pad, HKV_PAD=next_pow2(num_kv_heads),
        D=head_dim, D_PAD=d_pad, ROT=rot,
        num_warps=4 if hq_pad * d_pad <= 4096 else 8,
    )
    return q


def _ref_rope(x, cos, sin, rot):
    """x [T, H, D] (model dtype); cos/sin [T, rot/2] fp32 -> fp32 rotated x."""
    xf = x.float()
    half = rot // 2
    x1, x2 = xf[..., :half], xf[..., half:rot]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, xf[..., rot:]], dim=-1)


def reference_qk_norm_rope_cache(
    qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim,
    k_cache, v_cache, slot_mapping,
    q_norm_weight=None, k_norm_weight=None, eps=1e-6, rotary_dim=None, full_width_norm=False,
):
    rot = _check(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, rotary_dim,
                 q_norm_weight, k_norm_weight, full_width_norm)
    T = qkv.shape[0]
    q, k, v = qkv.view(T, -1, head_dim).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    if q_norm_weight is not None and full_width_norm:
        q = reference_rms_norm(q.reshape(T, -1), q_norm_weight, eps).view(T, num_heads, head_dim)
        k = reference_rms_norm(k.reshape(T, -1), k_norm_weight, eps).view(T, num_kv_heads, head_dim)
    elif q_norm_weight is not None:
        q = reference_rms_norm(q, q_norm_weight, eps)
        k = reference_rms_norm(k, k_norm_weight, eps)
    cs = cos_sin_cache.index_select(0, positions.long()).float()
    cos, sin = cs[:, : rot // 2], cs[:, rot // 2:]
    q = _ref_rope(q, cos, sin, rot).to(qkv.dtype)
    k = _ref_rope(k, cos, sin, rot)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    bs = k_cache.shape[1]
    blk, off = slots // bs, slots % bs
    k_cache[blk, off] = to_cache(k[keep].to(qkv.dtype), k_cache.dtype)
    v_cache[blk, off] = to_cache(v[keep], v_cache.dtype)
    return q.contiguous()


def fused_qk_norm_rope_cache(
    qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    q_norm_weight: Optional[torch.Tensor] = None, k_norm_weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6, rotary_dim: Optional[int] = None, full_width_norm: bool = False,
) -> torch.Tensor:
    """qkv [T, (Hq+2Hkv)*D] -> q [T, Hq, D]; rotated k and raw v go to the cache."""
    fn = fused_qk_norm_rope_cache_triton if use_triton(qkv) else reference_qk_norm_rope_cache
    return fn(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim,
              k_cache, v_cache, slot_mapping, q_norm_weight, k_norm_weight, eps, rotary_dim,
              full_width_norm)
