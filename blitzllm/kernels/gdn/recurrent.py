"""Decode's gated delta rule in one launch, each row's recurrent state read and written in place
in its slot of the state pool.

fla-core's fused recurrent kernel takes its initial states as a dense [B, Hv, dk, dv] tensor and
returns new ones, so calling it on pool slots costs a gather and a scatter around it: three
launches and three reads + writes of every state (2 MB per sequence and layer for Qwen3-Next),
where the rule itself needs one. This kernel addresses the slots directly.

One program per (row r, value head j, column block c), c fastest: it holds columns
c * BLOCK_V.. of value head j's state [dk, dv] of row r in registers (fp32): decay by exp(g),
the delta update with beta, the output o = S^T (q * scale). q and k come L2-normalized
(``post_conv_decode``); value head j reads key head j // (Hv / Hk). The new state goes to the
row's destination slot: its own (in place), or another (the runner's decode look-ahead, which
must leave the state it read intact until the step is kept). Reference:
``reference.reference_recurrent_gated_delta_rule``.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._common import next_pow2, tl, triton


@triton.jit
def _recurrent_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, dst_ptr, o_ptr,
                             stride_qr, stride_qh, stride_vr, stride_vh, stride_gr, stride_s, scale,
                             HK, HV, DK, DV,
                             BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    # column blocks fastest: neighbouring programs read neighbouring 32-byte pieces of the same
    # state rows, so each DRAM page is read whole by programs that run together
    pid = tl.program_id(0)
    nv = tl.cdiv(DV, BLOCK_V)
    c, rj = pid % nv, pid // nv
    r, j = rj // HV, rj % HV
    i = j // (HV // HK)
    kk = tl.arange(0, BLOCK_K)
    vv = c * BLOCK_V + tl.arange(0, BLOCK_V)
    mk, mv = kk < DK, vv < DV
    slot = tl.load(slot_ptr + r).to(tl.int64)
    dst = tl.load(dst_ptr + r).to(tl.int64)
    tile = j * DK * DV + kk[:, None] * DV + vv[None, :]
    mask = mk[:, None] & mv[None, :]
    h = tl.load(state_ptr + slot * stride_s + tile, mask=mask, other=0.0)
    q = tl.load(q_ptr + r * stride_qr + i * stride_qh + kk, mask=mk, other=0.0).to(tl.float32) * scale
    k = tl.load(k_ptr + r * stride_qr + i * stride_qh + kk, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + r * stride_vr + j * stride_vh + vv, mask=mv, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + r * stride_gr + j)
    beta = tl.load(beta_ptr + r * stride_gr + j)
    h = h * tl.exp(g)
    u = beta * (v - tl.sum(h * k[:, None], 0))
    h = h + k[:, None] * u[None, :]
    o = tl.sum(h * q[:, None], 0)
    tl.store(state_ptr + dst * stride_s + tile, h, mask=mask)
    tl.store(o_ptr + r * stride_vr + j * stride_vh + vv, o.to(o_ptr.dtype.element_ty), mask=mv)


def recurrent_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            state: torch.Tensor, slots: torch.Tensor, scale: Optional[float] = None,
                            dst_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q, k [B, Hk, dk] (L2-normalized), v [B, Hv, dv], g, beta [B, Hv] fp32; state [slots, Hv,
    dk, dv] fp32 (contiguous), read at rows ``slots`` [B] and written at rows ``dst_slots``
    (default: the same, in place; distinct, but for the scratch slot of padded rows). Returns
    o [B, Hv, dv] in v's dtype."""
    B, hk, dk = q.shape
    hv, dv = v.shape[1:]
    assert k.stride() == q.stride() and q.stride(2) == 1 and v.stride(2) == 1 and hv % hk == 0
    assert state.dtype == torch.float32 and state.is_contiguous() and state.shape[1:] == (hv, dk, dv)
    assert g.dtype == beta.dtype == torch.float32 and g.stride() == beta.stride() and g.stride(1) == 1
    o = torch.empty(B, hv, dv, dtype=v.dtype, device=v.device)
    if B == 0:
        return o
    v = v if v.stride() == o.stride() else v.contiguous()
    block_v = min(8, next_pow2(dv))  # 8 columns x 128 keys: 32 fp32 registers a thread at one warp
    _recurrent_decode_kernel[(B * hv * triton.cdiv(dv, block_v),)](
        q, k, v, g, beta, state, slots, slots if dst_slots is None else dst_slots, o,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), g.stride(0), state.stride(0),
        dk ** -0.5 if scale is None else scale, hk, hv, dk, dv,
        BLOCK_K=next_pow2(dk), BLOCK_V=block_v, num_warps=1)
    return o
