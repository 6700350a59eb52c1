"""Attention over the paged KV cache: per-step ``AttentionMetadata``, the scoped
``forward_context`` the runner enters and layers read, and the backends (the pure-torch
reference, Triton on CUDA). Knows nothing about requests or the scheduler.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..kernels.attention.kv_store import copy_rows
from .rotary import apply_rotary_tables, rotary_tables


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [T] int64, negative = do not write
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor         # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor     # [B, max_blocks] int32
    max_q_len: int
    max_seq_len: int
    q_lens_host: list
    seq_lens_host: list
    padded: bool = False           # slot_mapping may hold negative (padding) entries

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_q_len == 1


class AttentionBackend:
    """Per layer and step: optional per-head q/k norm, rotary, writing k/v into the paged
    cache, and attention over it. ``layer`` is the ``Attention`` module (heads, norms, rotary)."""

    name = "base"

    def forward(self, layer: "Attention", positions, qkv, k_cache, v_cache, md: AttentionMetadata):
        raise NotImplementedError


def write_kv_torch(k, v, k_cache, v_cache, slot_mapping, padded: bool = True):
    nb, bs, h, d = k_cache.shape
    if padded:  # the boolean mask costs a host sync; unpadded batches skip it
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    copy_rows(k_cache.view(nb * bs, h, d), slot_mapping, k)
    copy_rows(v_cache.view(nb * bs, h, d), slot_mapping, v)


def _block_index(block_row, length, bs):
    return block_row[:(length + bs - 1) // bs].long()


def _gather(cache, block_row, length, index=None):
    """One sequence's first ``length`` cache rows, [length, Hkv, D]; ``index`` is its
    ``_block_index`` when the caller already has it."""
    if index is None:
        index = _block_index(block_row, length, cache.shape[1])
    return cache.index_select(0, index).flatten(0, 1)[:length]


def _grouped_attention(q, k, v, mask, scale):
    """q [Hkv, G, Q, D], k/v [Hkv, L, D], mask [Q, L] or broadcastable -> [Hkv, G, Q, D].
    GQA without materialising repeated k/v: the G query heads of a kv head share one matmul."""
    hkv, g, nq, d = q.shape
    s = torch.matmul(q.reshape(hkv, g * nq, d), k.transpose(1, 2)).view(hkv, g, nq, -1).float() * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).to(v.dtype)
    return torch.matmul(p.view(hkv, g * nq, -1), v).view(hkv, g, nq, d)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, layer, positions, qkv, k_cache, v_cache, md):
        T = qkv.shape[0]
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        heads = qkv.view(T, hq + 2 * hkv, d)
        v = heads[:, hq + hkv:]
        if layer.q_norm is not None and getattr(layer, "full_width_qk_norm", False):
            # one RMSNorm over all q heads together, one over all k heads (MiniMax-M2)
            q = layer.q_norm(qkv[:, :hq * d]).view(T, hq, d)
            qk = torch.cat([q, layer.k_norm(qkv[:, hq * d:(hq + hkv) * d]).view(T, hkv, d)], 1)
        elif layer.q_norm is not None:
            qk = torch.cat([layer.q_norm(heads[:, :hq]), layer.k_norm(heads[:, hq:hq + hkv])], 1)
        else:
            qk = heads[:, :hq + hkv]
        qk = apply_rotary_tables(qk, *step_rotary_tables(layer.rotary, positions))  # q and k together
        q, k = qk[:, :hq], qk[:, hq:]
        write_kv_torch(k, v, k_cache, v_cache, md.slot_mapping, md.padded)
        return self.attend(q, k_cache, v_cache, md, layer.scale)

    def attend(self, q, k_cache, v_cache, md, scale):
        hq, hkv, d = q.shape[1], k_cache.shape[2], q.shape[2]
        group = hq // hkv
        if md.is_pure_decode:
            if md.num_seqs == 1 and not md.padded:
                return _single_decode_sdpa(q, k_cache, v_cache, md, scale)
            return self._decode(q, k_cache, v_cache, md, scale, group)
        out = torch.empty_like(q)
        start = 0
        for b, (ql, sl) in enumerate(zip(md.q_lens_host, md.seq_lens_host)):
            kb = _gather(k_cache, md.block_tables[b], sl).transpose(0, 1).to(q.dtype)  # [Hkv, L, D]
            vb = _gather(v_cache, md.block_tables[b], sl).transpose(0, 1).to(q.dtype)
            if q.device.type == "cpu":
                # torch's fused CPU attention (flash, fp32 sums): several times the speed of the
                # matmul / mask / softmax ops below on a CPU prefill; the GQA heads share k / v
                qb = q[start:start + ql].transpose(0, 1)[None]  # [1, Hq, Q, D]
                causal = sl == ql
                mask = None if causal else (torch.arange(sl)[None, :] <= torch.arange(sl - ql, sl)[:, None])
                o = nn.functional.scaled_dot_product_attention(
                    qb, kb[None], vb[None], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=group > 1)
                out[start:start + ql] = o[0].transpose(0, 1)
                start += ql
                continue
            qb = q[start:start + ql].view(ql, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, G, Q, D]
            qpos = torch.arange(sl - ql, sl, device=q.device)
            mask = torch.arange(sl, device=q.device)[None, :] <= qpos[:, None]
            o = _grouped_attention(qb, kb, vb, mask, scale)
            out[start:start + ql] = o.permute(2, 0, 1, 3).reshape(ql, hq, d)
            start += ql
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, md, scale, group):
        bs, hkv = k_cache.shape[1], k_cache.shape[2]
        nblk = (md.max_seq_len + bs - 1) // bs
        bt = md.block_tables[:, :nblk].long()
        B, hq, d = q.shape
        kb = k_cache[bt].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
        vb = v_cache[bt].flatten(1, 2).transpose(1, 2).to(q.dtype)
        L = kb.shape[2]
        qg = q.view(B, hkv, group, d)
        s = torch.matmul(qg, kb.transpose(2, 3)).float() * scale  # [B, Hkv, G, L]
        mask = torch.arange(L, device=q.device)[None, :] < md.seq_lens[:, None].long()
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).to(vb.dtype)
        return torch.matmul(p, vb).reshape(B, hq, d)


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list          # per layer (k_cache, v_cache)
    backend: AttentionBackend
    scratch: dict = field(default_factory=dict)  # per-step values shared by the layers
    lora: object = None      # with enable_lora: the rows' adapter slots (blitzllm/lora LoRARows)
    # M-RoPE steps (images in the chunk): each token's cos/sin row [T, rotary_dim]; positions are
    # then 0..T-1, indexing these rows instead of the rotary's table
    rope_rows: Optional[torch.Tensor] = None


_CURRENT: list = []


@contextlib.contextmanager
def forward_context(ctx: ForwardContext):
    """Scoped per-step state for attention layers; cannot nest, always cleared."""
    if _CURRENT:
        raise RuntimeError("forward_context cannot nest")
    _CURRENT.append(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.clear()


def get_forward_context() -> ForwardContext:
    if not _CURRENT:
        raise RuntimeError("attention called outside forward_context")
    return _CURRENT[0]


def step_rotary_tables(rotary, positions: torch.Tensor) -> tuple:
    """``rotary_tables`` of ``rotary`` at this step's positions, gathered once per step for all
    layers (in the step's scratch; outside a forward context, every call)."""
    scratch = get_forward_context().scratch if _CURRENT else {}
    key = ("rope", id(rotary))
    if key not in scratch:
        scratch[key] = rotary_tables(cos_sin_table(rotary), positions)
    return scratch[key]


def cos_sin_table(rotary) -> torch.Tensor:
    """The cos/sin rows the step's positions index: the rotary's table, or an M-RoPE step's
    per-token rows (``ForwardContext.rope_rows``)."""
    rows = _CURRENT[0].rope_rows if _CURRENT else None
    return rotary.cos_sin_cache if rows is None else rows


class TritonAttentionBackend(AttentionBackend):
    """CUDA: one fused kernel for q/k norm + rotary + cache write, then paged attention
    (split-K flash decoding for pure decode steps, varlen causal prefill otherwise)."""

    name = "triton"

    def __init__(self):
        # Pure decode steps run q/k norm + rotary + cache write inside the attention kernel
        # (one launch per layer) unless a step may hold several rows of one sequence
        # (speculative verify rows): the model runner turns it off then.
        self.fused_decode = True

    def forward(self, layer, positions, qkv, k_cache, v_cache, md):
        from ..kernels.attention.paged import paged_decode_attention_triton, paged_prefill_attention_triton
        from ..kernels.attention.qk_norm_rope_cache import fused_qk_norm_rope_cache_triton
        if self._fused_decode_ok(layer, md):
            return self._fused_decode(layer, positions, qkv, k_cache, v_cache, md,
                                      early_dependents=_next_streams_early(layer, qkv))
        q = fused_qk_norm_rope_cache_triton(
            qkv, positions, cos_sin_table(layer.rotary), layer.num_heads, layer.num_kv_heads, layer.head_dim,
            k_cache, v_cache, md.slot_mapping, full_width_norm=getattr(layer, "full_width_qk_norm", False),
            **_norm_rope_kwargs(layer))
        if md.is_pure_decode:
            return paged_decode_attention_triton(q, k_cache, v_cache, md.block_tables, md.seq_lens, layer.scale)
        if md.num_seqs == 1 and md.q_lens_host[0] == md.seq_lens_host[0] >= _SDPA_MIN_LEN:
            return _long_prompt_sdpa(q, k_cache, v_cache, md, layer.scale)
        return paged_prefill_attention_triton(q, k_cache, v_cache, md.query_start_loc, md.seq_lens,
                                              md.block_tables, layer.scale, md.max_q_len)

    def _fused_decode_ok(self, layer, md) -> bool:
        """Whether this step's attention runs as the one-launch fused decode kernel."""
        return md.is_pure_decode and self.fused_decode and not getattr(layer, "full_width_qk_norm", False)

    @staticmethod
    def _fused_decode(layer, positions, qkv, k_cache, v_cache, md, **kw):
        """``fused_decode_attention_triton`` for ``layer`` (its heads, norms, rotary) with ``kw``."""
        from ..kernels.attention.paged import fused_decode_attention_triton
        return fused_decode_attention_triton(
            qkv, positions, cos_sin_table(layer.rotary), layer.num_heads, layer.num_kv_heads, layer.head_dim,
            k_cache, v_cache, md.slot_mapping, md.block_tables, md.seq_lens, layer.scale, **_norm_rope_kwargs(layer),
            **kw)


def _norm_rope_kwargs(layer) -> dict:
    """The q/k norm and rotary arguments of the fused Triton kernels for ``layer``."""
    qn, kn = layer.q_norm, layer.k_norm
    return {"q_norm_weight": None if qn is None else qn.weight, "k_norm_weight": None if kn is None else kn.weight,
            "eps": 1e-6 if qn is None else qn.eps, "rotary_dim": layer.rotary.rotary_dim}


def _next_streams_early(layer, qkv) -> bool:
    """Whether the projection after this decode attention (``layer.preload_next``, o_proj)
    runs the TMA GEMV, which streams its weights before its wait: then the attention lets
    it launch as the attention starts."""
    nxt = getattr(layer, "preload_next", ())
    if not nxt:
        return False
    o_proj = nxt[0]
    # (the attention output is [rows, in_features] of qkv's dtype and device: a view stands in)
    return o_proj.tma_ok(qkv[:, :o_proj.in_features])


_SDPA_MIN_LEN = 2048


def _single_decode_sdpa(q, k_cache, v_cache, md, scale):
    """One sequence, one new token: no mask needed, so torch's fused attention (one op on
    the CPU path, where per-op overhead dominates a batch-1 decode)."""
    n = md.seq_lens_host[0]
    hq, hkv = q.shape[1], k_cache.shape[2]
    scratch = get_forward_context().scratch if _CURRENT else {}
    if "blocks" not in scratch:  # the same for every layer of this step
        scratch["blocks"] = _block_index(md.block_tables[0], n, k_cache.shape[1])
    k = _gather(k_cache, None, n, scratch["blocks"]).transpose(0, 1).to(q.dtype)  # [Hkv, L, D]
    v = _gather(v_cache, None, n, scratch["blocks"]).transpose(0, 1).to(q.dtype)
    o = nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], scale=scale,
                                                   enable_gqa=hq != hkv)
    return o[0].transpose(0, 1)


def _long_prompt_sdpa(q, k_cache, v_cache, md, scale):
    """A single uncached long prompt: its k/v sit in the cache contiguous per block; gather them
    once and use torch's flash attention."""
    n = md.seq_lens_host[0]
    g = q.shape[1] // k_cache.shape[2]
    k = _gather(k_cache, md.block_tables[0], n).transpose(0, 1).to(q.dtype)
    v = _gather(v_cache, md.block_tables[0], n).transpose(0, 1).to(q.dtype)
    if g > 1:
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    o = nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], is_causal=True,
                                                   scale=scale)
    return o[0].transpose(0, 1)


def select_backend(device: torch.device, name: str = "auto") -> AttentionBackend:
    """auto: Triton on CUDA when it imports, else the torch reference."""
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"attention_backend must be auto, torch or triton; got {name!r}")
    from ..kernels._common import HAS_TRITON
    if name == "triton" and (device.type != "cuda" or not HAS_TRITON):
        raise ValueError("attention_backend='triton' needs a CUDA device and the triton package")
    if name == "triton" or (name == "auto" and device.type == "cuda" and HAS_TRITON):
        return TritonAttentionBackend()
    return TorchAttentionBackend()


class Attention(nn.Module):
    """Attention over the paged cache from a packed qkv projection output, with optional q/k norms
    per head or (``full_width_qk_norm``) over all heads of q and of k. ``pre_norm`` (qkv -> qkv)
    runs before the backend: the tensor-parallel full-width q/k norm, whose heads span the ranks."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int, rotary,
                 q_norm=None, k_norm=None, full_width_qk_norm: bool = False, pre_norm=None):
        super().__init__()
        self.full_width_qk_norm = full_width_qk_norm
        self.pre_norm = pre_norm
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_idx = layer_idx
        self.rotary = rotary
        self._norms = (q_norm, k_norm)  # a tuple: owned (and named) by the caller, not registered here
        self.scale = head_dim ** -0.5
        # set by the runner's decode plan: the projection after this attention, when it streams
        # its weights before its wait (the TMA GEMV) so decode attention lets it launch at once
        self.preload_next: tuple = ()

    @property
    def q_norm(self):
        return self._norms[0]

    @property
    def k_norm(self):
        return self._norms[1]

    def forward(self, positions, qkv):
        """qkv [T, (Hq + 2 Hkv) * D] -> [T, Hq * D]."""
        ctx = get_forward_context()
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        if self.pre_norm is not None:
            qkv = self.pre_norm(qkv)
        out = ctx.backend.forward(self, positions, qkv, k_cache, v_cache, ctx.attn_metadata)
        return out.reshape(out.shape[0], -1)
