"""Decode's post-projection path of a GDN layer in one launch (the fusion vLLM added for
Qwen3.5): for each row (one new token of a sequence) the conv-state update, the depthwise
causal conv + SiLU, the split into contiguous q / k / v, the per-head L2 norm of q and k, and
the gates g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) in fp32.

Grid (rows, Hk + Hv): program (r, h < Hk) does key head h's q and k channels, program
(r, Hk + j) value head j's v channels and its g and beta. The conv runs in fp32 over the
slot's K - 1 saved inputs and the new one; the state then shifts by one (into the row's
destination slot, its own unless the runner's look-ahead asks for another). Reference:
``reference.reference_post_conv_decode``.
"""
from __future__ import annotations

import torch

from .._common import next_pow2, tl, triton
from .reference import L2_EPS


@triton.jit
def _conv_silu(x_row, state_row, dst_row, stride_st, w_ptr, bias_ptr, chans, mask,
               KW: tl.constexpr, HAS_BIAS: tl.constexpr):
    """fp32 silu(conv) of ``chans`` for one token over the state at ``state_row``; the state
    shifted by one with the token at the end written at ``dst_row`` (the same row: in place)."""
    xt = tl.load(x_row + chans, mask=mask, other=0.0)
    acc = xt.to(tl.float32) * tl.load(w_ptr + chans * KW + (KW - 1), mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(KW - 1):
        s = tl.load(state_row + j * stride_st + chans, mask=mask, other=0.0)
        acc += s.to(tl.float32) * tl.load(w_ptr + chans * KW + j, mask=mask, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(dst_row + (j - 1) * stride_st + chans, s, mask=mask)
    tl.store(dst_row + (KW - 2) * stride_st + chans, xt.to(dst_row.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + chans, mask=mask, other=0.0).to(tl.float32)
    return acc * tl.sigmoid(acc)


@triton.jit
def _post_conv_decode_kernel(
    x_ptr, stride_x, a_ptr, stride_a, b_ptr, stride_b,
    state_ptr, stride_ss, stride_st, slot_ptr, dst_ptr,
    w_ptr, bias_ptr, alog_ptr, dtb_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
    HK, HV, DK, DV, eps,
    KW: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    x_row = x_ptr + row * stride_x
    state_row = state_ptr + slot * stride_ss
    dst_row = state_ptr + tl.load(dst_ptr + row).to(tl.int64) * stride_ss
    if h < HK:
        offs_k = tl.arange(0, BLOCK_DK)
        mk = offs_k < DK
        qc = h * DK + offs_k
        q = _conv_silu(x_row, state_row, dst_row, stride_st, w_ptr, bias_ptr, qc, mk, KW, HAS_BIAS)
        k = _conv_silu(x_row, state_row, dst_row, stride_st, w_ptr, bias_ptr, qc + HK * DK, mk, KW, HAS_BIAS)
        q = tl.where(mk, q, 0.0)
        k = tl.where(mk, k, 0.0)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
        out = (row * HK + h) * DK + offs_k
        tl.store(q_ptr + out, q.to(q_ptr.dtype.element_ty), mask=mk)
        tl.store(k_ptr + out, k.to(k_ptr.dtype.element_ty), mask=mk)
    else:
        j = h - HK
        offs_v = tl.arange(0, BLOCK_DV)
        mv = offs_v < DV
        v = _conv_silu(x_row, state_row, dst_row, stride_st, w_ptr, bias_ptr, 2 * HK * DK + j * DV + offs_v, mv, KW, HAS_BIAS)
        tl.store(v_ptr + (row * HV + j) * DV + offs_v, v.to(v_ptr.dtype.element_ty), mask=mv)
        a = tl.load(a_ptr + row * stride_a + j).to(tl.float32) + tl.load(dtb_ptr + j).to(tl.float32)
        # softplus as torch's (threshold 20), exp(a) where 1 + exp(a) rounds to 1
        sp = tl.where(a > 20.0, a, tl.where(a < -15.0, tl.exp(a), tl.log(1.0 + tl.exp(a))))
        g = -tl.exp(tl.load(alog_ptr + j).to(tl.float32)) * sp
        b = tl.load(b_ptr + row * stride_b + j).to(tl.float32)
        tl.store(g_ptr + row * HV + j, g)
        tl.store(beta_ptr + row * HV + j, tl.sigmoid(b))


def post_conv_decode_triton(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_state: torch.Tensor,
                            slots: torch.Tensor, conv_weight: torch.Tensor, conv_bias, A_log: torch.Tensor,
                            dt_bias: torch.Tensor, hk: int, dk: int, hv: int, dv: int, dst_slots=None):
    """See the module docstring. mixed_qkv [B, C] and a, b [B, Hv] may be row-strided views
    (columns contiguous); conv_state [slots, K - 1, C] with contiguous channels, read at rows
    ``slots`` and written at ``dst_slots`` (default: the same rows, in place); conv_weight
    [C, K] contiguous. Returns q, k [B, Hk, dk], v [B, Hv, dv] in mixed_qkv's dtype, g and
    beta [B, Hv] fp32."""
    B, C = mixed_qkv.shape
    kw = conv_weight.shape[1]
    assert C == 2 * hk * dk + hv * dv and conv_weight.shape[0] == C and conv_weight.is_contiguous()
    assert conv_state.shape[1:] == (kw - 1, C) and conv_state.stride(2) == 1 and kw >= 2
    assert mixed_qkv.stride(1) == 1 and a.stride(1) == 1 and b.stride(1) == 1
    dt, dev = mixed_qkv.dtype, mixed_qkv.device
    q = torch.empty(B, hk, dk, dtype=dt, device=dev)
    k = torch.empty(B, hk, dk, dtype=dt, device=dev)
    v = torch.empty(B, hv, dv, dtype=dt, device=dev)
    g = torch.empty(B, hv, dtype=torch.float32, device=dev)
    beta = torch.empty(B, hv, dtype=torch.float32, device=dev)
    if B == 0:
        return q, k, v, g, beta
    bias = conv_bias if conv_bias is not None else conv_weight
    _post_conv_decode_kernel[(B, hk + hv)](
        mixed_qkv, mixed_qkv.stride(0), a, a.stride(0), b, b.stride(0),
        conv_state, conv_state.stride(0), conv_state.stride(1), slots, slots if dst_slots is None else dst_slots,
        conv_weight, bias, A_log, dt_bias, q, k, v, g, beta,
        hk, hv, dk, dv, L2_EPS,
        KW=kw, BLOCK_DK=next_pow2(dk), BLOCK_DV=next_pow2(dv), HAS_BIAS=conv_bias is not None,
        num_warps=4 if max(dk, dv) >= 256 else 2)
    return q, k, v, g, beta
