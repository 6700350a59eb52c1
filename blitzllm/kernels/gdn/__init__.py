"""Gated delta net (GDN) ops: the entry points a GDN layer calls, each dispatching to CUDA
kernels or to its torch reference (``reference.py``; inside ``kernels._common.reference_ops``,
the ``BLITZ_REFERENCE`` knob, or with ``reference=True`` every op takes its reference).

- ``causal_conv1d_prefill``: depthwise causal conv + SiLU of a varlen batch continuing
  from (and updating) per-sequence conv states. CUDA: fla-core's Triton ``causal_conv1d``.
- ``gated_delta_rule_prefill``: the chunked rule with ``cu_seqlens`` and initial states.
  CUDA: fla-core's ``chunk_gated_delta_rule``.
- ``post_conv_decode``: decode's conv-state update + conv + SiLU + q/k/v split + q/k L2
  norm + g and beta, one launch per layer (our Triton kernel, ``post_conv.py``).
- ``gated_delta_rule_decode``: one token per sequence, reading and writing the recurrent
  states of its slots in place (our Triton kernel, ``recurrent.py``: fla-core's recurrent
  kernel takes dense states, which would cost a gather and a scatter around it).
- ``gdn_gates`` (prefill's g and beta): torch on every device for now.
- ``rms_norm_gated`` (the output norm, w * rmsnorm(o) * silu(z) per value head). CUDA: one
  launch (our Triton kernel, ``norm_gated.py``).

fla-core (a well-kept library, ``pip install fla-core``) is imported on first use on a CUDA
device; its absence there is an ImportError that says so. Recurrent states are fp32
[slots, Hv, dk, dv]; conv states [slots, K - 1, C] in the model dtype (see reference.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from .._common import use_triton
from .reference import (  # noqa: F401  (re-exported: the family's references)
    L2_EPS,
    reference_causal_conv1d,
    reference_causal_conv1d_update,
    reference_chunk_gated_delta_rule,
    reference_gdn_gates,
    reference_l2norm,
    reference_post_conv_decode,
    reference_recurrent_gated_delta_rule,
    reference_rms_norm_gated,
    split_qkv,
)

FLA_HINT = "pip install fla-core==0.6.0"


def _on_gpu(t: torch.Tensor, reference: bool) -> bool:
    return not reference and use_triton(t)


def fla_ops():
    """fla-core's (chunk_gated_delta_rule, causal_conv1d): the prefill kernels."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        raise ImportError(f"gated delta net layers on CUDA need fla-core's kernels ({FLA_HINT}): {e}") from e
    return chunk_gated_delta_rule, causal_conv1d


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          conv_state: torch.Tensor, slots: torch.Tensor, has_initial: torch.Tensor,
                          cu_seqlens: torch.Tensor, host: tuple, reference: bool = False) -> torch.Tensor:
    """SiLU(causal conv) of x [T, C] per sequence (weight [C, K]), each continuing from its
    slot's conv state where ``has_initial`` (else from zeros), the states updated in place.
    ``slots`` [N] int, ``has_initial`` [N] bool, ``cu_seqlens`` [N + 1] int on x's device;
    ``host``: (slots, has_initial, cu_seqlens) as host lists (the torch path loops on them)."""
    if not _on_gpu(x, reference):
        return reference_causal_conv1d(x, weight, bias, conv_state, *host)
    causal_conv1d = fla_ops()[1]
    idx = slots.long()
    K = weight.shape[1]
    # fla's states are [N, C, K] (the last K inputs); ours keep the last K - 1
    init = conv_state.index_select(0, idx).transpose(1, 2) * has_initial[:, None, None].to(conv_state.dtype)
    init = torch.cat([init.new_zeros(init.shape[0], init.shape[1], 1), init], 2).contiguous()
    y, final = causal_conv1d(x.contiguous()[None], weight, bias, initial_state=init, output_final_state=True,
                             activation="silu", cu_seqlens=cu_seqlens.long())
    conv_state.index_copy_(0, idx, final[:, :, -(K - 1):].transpose(1, 2).to(conv_state.dtype))
    return y[0]


def gated_delta_rule_prefill(q, k, v, g, beta, state: torch.Tensor, slots: torch.Tensor, has_initial: torch.Tensor,
                             cu_seqlens: torch.Tensor, host_cu_seqlens: list, scale: Optional[float] = None,
                             reference: bool = False) -> torch.Tensor:
    """The chunked rule over a varlen batch (q, k [T, Hk, dk] L2-normalized inside, v
    [T, Hv, dv], g / beta [T, Hv] fp32), each sequence starting from its slot's recurrent
    state where ``has_initial`` (else zeros); the final states written back to the slots.
    Returns o [T, Hv, dv] in v's dtype."""
    idx = slots.long()
    init = state.index_select(0, idx) * has_initial[:, None, None, None].to(state.dtype)
    if _on_gpu(v, reference):
        chunk = fla_ops()[0]
        o, final = chunk(q=q.contiguous()[None], k=k.contiguous()[None], v=v.contiguous()[None],
                         g=g.contiguous()[None], beta=beta.contiguous()[None], scale=scale, initial_state=init,
                         output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens.long())
        o = o[0]
    else:
        o, final = reference_chunk_gated_delta_rule(q, k, v, g, beta, host_cu_seqlens, init, scale,
                                                    use_qk_l2norm=True)
    state.index_copy_(0, idx, final.to(state.dtype))
    return o


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """(g, beta) fp32 of the prefill path, torch on every device (elementwise; decode computes
    them inside ``post_conv_decode``)."""
    return reference_gdn_gates(a, b, A_log, dt_bias)


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   reference: bool = False) -> torch.Tensor:
    """w * rmsnorm(x) * silu(z) per value head (``RMSNormGated``), in x's dtype; z may be a
    row-strided view of the projection output. See ``norm_gated.py``."""
    if _on_gpu(x, reference):
        from .norm_gated import rms_norm_gated_triton
        return rms_norm_gated_triton(x, z, weight, eps)
    return reference_rms_norm_gated(x, z, weight, eps)


def post_conv_decode(mixed_qkv, a, b, conv_state, slots, conv_weight, conv_bias, A_log, dt_bias,
                     hk: int, dk: int, hv: int, dv: int, dst_slots=None, reference: bool = False):
    """See ``post_conv.py``; returns (q, k, v, g, beta) with q and k L2-normalized. The conv
    states are read at ``slots`` and written at ``dst_slots`` (default: the same rows)."""
    if _on_gpu(mixed_qkv, reference):
        from .post_conv import post_conv_decode_triton
        return post_conv_decode_triton(mixed_qkv, a, b, conv_state, slots, conv_weight, conv_bias, A_log, dt_bias,
                                       hk, dk, hv, dv, dst_slots)
    return reference_post_conv_decode(mixed_qkv, a, b, conv_state, slots, conv_weight, conv_bias, A_log, dt_bias,
                                      hk, dk, hv, dv, dst_slots)


def gated_delta_rule_decode(q, k, v, g, beta, state: torch.Tensor, slots: torch.Tensor,
                            scale: Optional[float] = None, dst_slots: Optional[torch.Tensor] = None,
                            reference: bool = False) -> torch.Tensor:
    """One token per row (q, k [B, Hk, dk] already L2-normalized, v [B, Hv, dv], g / beta
    [B, Hv]) continuing each row's slot state, the new one written at ``dst_slots`` (default:
    back into ``slots``). Returns o [B, Hv, dv]."""
    if _on_gpu(v, reference):
        from .recurrent import recurrent_decode_triton
        return recurrent_decode_triton(q, k, v, g, beta, state, slots, scale, dst_slots)
    o, final = reference_recurrent_gated_delta_rule(q, k, v, g, beta, range(q.shape[0] + 1),
                                                    state.index_select(0, slots.long()), scale)
    state.index_copy_(0, (slots if dst_slots is None else dst_slots).long(), final.to(state.dtype))
    return o
