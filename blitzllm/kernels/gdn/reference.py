"""Torch references of the gated delta net (GDN) ops, on flat varlen batches.

Layouts: tokens are flat rows, sequences given by ``cu_seqlens`` ([N + 1] offsets, a host
list or a tensor). q / k [T, Hk, dk], v [T, Hv, dv] (Hv a multiple of Hk: key head i serves
value heads i * Hv / Hk ...), g (log decay, <= 0) and beta [T, Hv] fp32. Recurrent states
[N, Hv, dk, dv] fp32. Conv states [slots, K - 1, C]: the last K - 1 conv inputs of a
sequence, oldest first, channels contiguous; ``slots`` [N] picks each sequence's row.

The rule, per value head: S <- exp(g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;
o_t = S^T (scale q_t). The chunked form below computes the same over chunks of 64 tokens
with a triangular solve per chunk (the WY / UT form of DeltaNet), derived in its docstring.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

L2_EPS = 1e-6
CHUNK = 64


def _as_list(values) -> list:
    """A host list of ``values`` (a tensor or a sequence)."""
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def reference_l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim, in fp32 (the form of fla and transformers)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def reference_gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """(g, beta), both fp32 [T, Hv]: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def reference_rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * rmsnorm(x) * silu(z) over the last dim (a value head), with transformers' roundings:
    the normalized x rounded to x's dtype, times w in that dtype, times silu(z) in fp32,
    rounded once more."""
    dt = x.dtype
    xf = x.float()
    n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    return ((weight.to(dt) * n) * F.silu(z.float())).to(dt)


def _expand_heads(q, k, hv):
    """Key heads repeated onto their value heads: [..., Hk, d] -> [..., Hv, d]."""
    r = hv // k.shape[-2]
    if r == 1:
        return q, k
    return q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2)


def _prep(q, k, v, g, beta, scale, use_qk_l2norm):
    hv = v.shape[-2]
    q, k = (reference_l2norm(q), reference_l2norm(k)) if use_qk_l2norm else (q.float(), k.float())
    q, k = _expand_heads(q, k, hv)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v.float(), g.float(), beta.float()


def reference_recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state: Optional[torch.Tensor] = None,
                                         scale: Optional[float] = None, use_qk_l2norm: bool = False,
                                         keep_states: bool = False):
    """The rule token by token. Returns (o [T, Hv, dv] in v's dtype, final states [N, Hv, dk, dv]
    fp32); with ``keep_states`` also the state after every token [T, Hv, dk, dv]."""
    bounds = _as_list(cu_seqlens)
    qf, kf, vf, gf, bf = _prep(q, k, v, g, beta, scale, use_qk_l2norm)
    T, hv, dv = vf.shape
    dk = kf.shape[-1]
    o = torch.empty(T, hv, dv, dtype=torch.float32, device=v.device)
    finals = torch.zeros(len(bounds) - 1, hv, dk, dv, dtype=torch.float32, device=v.device)
    every = torch.empty(T, hv, dk, dv, dtype=torch.float32, device=v.device) if keep_states else None
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        S = initial_state[n].float().clone() if initial_state is not None else finals[n]
        for t in range(s, e):
            S = S * gf[t].exp()[:, None, None]
            err = vf[t] - torch.einsum("hk,hkv->hv", kf[t], S)
            S = S + kf[t][:, :, None] * (bf[t][:, None] * err)[:, None, :]
            o[t] = torch.einsum("hk,hkv->hv", qf[t], S)
            if every is not None:
                every[t] = S
        finals[n] = S
    out = (o.to(v.dtype), finals)
    return out + (every,) if keep_states else out


def _chunk_step(q, k, v, g, beta, S):
    """One chunk of C tokens of every head (q, k [H, C, dk], v [H, C, dv], g, beta [H, C],
    S [H, dk, dv]) -> (o [H, C, dv], S after the chunk).

    With gamma_i = sum_{j<=i} g_j (cumulative log decay inside the chunk), the state after
    token i is S_i = e^{gamma_i} S + sum_{j<=i} e^{gamma_i - gamma_j} k_j u_j^T, where u_j is the
    update written by token j: u_j = beta_j (v_j - e^{gamma_j} S^T k_j - sum_{l<j}
    e^{gamma_j - gamma_l} (k_j . k_l) u_l). Stacked, (I + A) U = beta (V - diag(e^gamma) K S) with
    A_jl = beta_j e^{gamma_j - gamma_l} k_j . k_l (l < j), a unit lower-triangular solve. Then
    O = diag(e^gamma) Q S + (M * Q K^T) U with M_ij = e^{gamma_i - gamma_j} (j <= i), and the
    chunk's final state is e^{gamma_C} S + (diag(e^{gamma_C - gamma}) K)^T U."""
    C = q.shape[1]
    gam = g.cumsum(-1)                                        # [H, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = (gam[:, :, None] - gam[:, None, :]).masked_fill(~causal, float("-inf"))
    decay = diff.exp()                                        # [H, C, C], e^{gamma_i - gamma_j}, j <= i
    kk = k @ k.transpose(1, 2)
    A = (beta[:, :, None] * kk * decay).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = beta[:, :, None] * (v - (gam.exp()[:, :, None] * k) @ S)
    U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    o = (gam.exp()[:, :, None] * q) @ S + ((q @ k.transpose(1, 2)) * decay) @ U
    tail = (gam[:, -1:] - gam).exp()                          # e^{gamma_C - gamma_j}
    S = gam[:, -1].exp()[:, None, None] * S + (tail[:, :, None] * k).transpose(1, 2) @ U
    return o, S


def reference_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state: Optional[torch.Tensor] = None,
                                     scale: Optional[float] = None, use_qk_l2norm: bool = False,
                                     chunk: int = CHUNK):
    """The rule over chunks of ``chunk`` tokens (the prefill form); the same results as
    ``reference_recurrent_gated_delta_rule`` up to fp32 rounding. Returns (o [T, Hv, dv] in
    v's dtype, final states [N, Hv, dk, dv] fp32)."""
    bounds = _as_list(cu_seqlens)
    qf, kf, vf, gf, bf = _prep(q, k, v, g, beta, scale, use_qk_l2norm)
    T, hv, dv = vf.shape
    dk = kf.shape[-1]
    o = torch.empty(hv, T, dv, dtype=torch.float32, device=v.device)
    qh, kh, vh = qf.transpose(0, 1), kf.transpose(0, 1), vf.transpose(0, 1)  # [H, T, d]
    gh, bh = gf.t(), bf.t()
    finals = torch.zeros(len(bounds) - 1, hv, dk, dv, dtype=torch.float32, device=v.device)
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        S = initial_state[n].float() if initial_state is not None else finals[n]
        for c in range(s, e, chunk):
            d = slice(c, min(c + chunk, e))
            o[:, d], S = _chunk_step(qh[:, d], kh[:, d], vh[:, d], gh[:, d], bh[:, d], S)
        finals[n] = S
    return o.transpose(0, 1).to(v.dtype), finals


def reference_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                            conv_state: torch.Tensor, slots: Sequence[int], has_initial: Sequence[bool],
                            cu_seqlens, activation: bool = True) -> torch.Tensor:
    """Depthwise causal conv of each sequence of x [T, C] (weight [C, K]) continuing from its
    conv state (zeros where ``has_initial`` is false), SiLU when ``activation``; accumulates
    in fp32 and rounds once to x's dtype. Writes each sequence's last K - 1 inputs back into
    ``conv_state[slots[n]]``."""
    bounds, slots, has_initial = _as_list(cu_seqlens), _as_list(slots), _as_list(has_initial)
    K = weight.shape[1]
    w = weight.float()[:, None, :]
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        prev = conv_state[slots[n]].float() if has_initial[n] else x.new_zeros(K - 1, x.shape[1], dtype=torch.float32)
        ext = torch.cat([prev, x[s:e].float()], 0)           # [K - 1 + L, C]
        y = F.conv1d(ext.t()[None], w, None, groups=x.shape[1])[0].t()  # [L, C]
        out[s:e] = y if bias is None else y + bias.float()
        conv_state[slots[n]] = ext[-(K - 1):].to(conv_state.dtype)
    return (F.silu(out) if activation else out).to(x.dtype)


def reference_causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                   conv_state: torch.Tensor, slots: torch.Tensor,
                                   activation: bool = True, out_dtype: Optional[torch.dtype] = None,
                                   dst_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One new token per row of x [B, C]: the conv over its slot's state and itself (SiLU when
    ``activation``), the state shifted by one into ``dst_slots`` (default: the same slots); fp32
    inside, ``out_dtype`` (default x's) out."""
    idx = slots.long()
    prev = conv_state.index_select(0, idx).float()            # [B, K - 1, C]
    ext = torch.cat([prev, x.float()[:, None]], 1)            # [B, K, C]
    y = (ext * weight.float().t()[None]).sum(1)
    if bias is not None:
        y = y + bias.float()
    conv_state.index_copy_(0, (slots if dst_slots is None else dst_slots).long(), ext[:, 1:].to(conv_state.dtype))
    return (F.silu(y) if activation else y).to(out_dtype or x.dtype)


def split_qkv(mixed: torch.Tensor, hk: int, dk: int, hv: int, dv: int):
    """[T, 2 Hk dk + Hv dv] conv output -> q, k [T, Hk, dk], v [T, Hv, dv] (views)."""
    T = mixed.shape[0]
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    return q.reshape(T, hk, dk), k.reshape(T, hk, dk), v.reshape(T, hv, dv)


def reference_post_conv_decode(mixed_qkv, a, b, conv_state, slots, conv_weight, conv_bias, A_log, dt_bias,
                               hk: int, dk: int, hv: int, dv: int, dst_slots=None):
    """Decode's post-projection path, one token per row: conv-state update + conv + SiLU,
    split into q / k / v, per-head L2 norm of q and k, g and beta. Returns q, k [B, Hk, dk]
    (normalized from the fp32 conv output, then rounded to x's dtype), v [B, Hv, dv], g and
    beta [B, Hv] fp32."""
    y = reference_causal_conv1d_update(mixed_qkv, conv_weight, conv_bias, conv_state, slots, out_dtype=torch.float32,
                                       dst_slots=dst_slots)
    B, dt = y.shape[0], mixed_qkv.dtype
    q, k, v = y.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q = reference_l2norm(q.reshape(B, hk, dk)).to(dt)
    k = reference_l2norm(k.reshape(B, hk, dk)).to(dt)
    g, beta = reference_gdn_gates(a, b, A_log, dt_bias)
    return q, k, v.reshape(B, hv, dv).to(dt), g, beta
