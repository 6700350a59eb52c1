"""Attention over the paged KV cache: per-step metadata, a scoped forward context, and the
backend interface with its pure-torch reference backend (CPU and CUDA).

The model runner builds ``AttentionMetadata`` and enters ``forward_context``; attention
layers read it from there. Nothing here knows about requests or the scheduler.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


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

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_q_len == 1


class AttentionBackend:
    """Writes this step's k/v into the paged cache and attends over it."""

    name = "base"

    def forward(self, q, k, v, k_cache, v_cache, md: AttentionMetadata, scale: float) -> torch.Tensor:
        raise NotImplementedError


def write_kv_torch(k, v, k_cache, v_cache, slot_mapping):
    nb, bs, h, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(nb * bs, h, d).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def _gather(cache, block_row, length):
    bs = cache.shape[1]
    nblk = (length + bs - 1) // bs
    return cache[block_row[:nblk].long()].flatten(0, 1)[:length]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, md, scale):
        write_kv_torch(k, v, k_cache, v_cache, md.slot_mapping)
        hq, hkv = q.shape[1], k_cache.shape[2]
        group = hq // hkv
        if md.is_pure_decode:
            return self._decode(q, k_cache, v_cache, md, scale, group)
        out = torch.empty_like(q)
        start = 0
        for b, (ql, sl) in enumerate(zip(md.q_lens_host, md.seq_lens_host)):
            kb = _gather(k_cache, md.block_tables[b], sl).transpose(0, 1)
            vb = _gather(v_cache, md.block_tables[b], sl).transpose(0, 1)
            if group > 1:
                kb, vb = kb.repeat_interleave(group, 0), vb.repeat_interleave(group, 0)
            qb = q[start:start + ql].transpose(0, 1)
            qpos = torch.arange(sl - ql, sl, device=q.device)
            mask = torch.arange(sl, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qb, kb.to(qb.dtype), vb.to(qb.dtype), attn_mask=mask, scale=scale)
            out[start:start + ql] = o.transpose(0, 1)
            start += ql
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, md, scale, group):
        bs = k_cache.shape[1]
        nblk = (md.max_seq_len + bs - 1) // bs
        bt = md.block_tables[:, :nblk].long()
        B = q.shape[0]
        kb = k_cache[bt].flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
        vb = v_cache[bt].flatten(1, 2).transpose(1, 2)
        if group > 1:
            kb, vb = kb.repeat_interleave(group, 1), vb.repeat_interleave(group, 1)
        L = kb.shape[2]
        mask = torch.arange(L, device=q.device)[None, :] < md.seq_lens[:, None].long()
        o = F.scaled_dot_product_attention(q[:, :, None, :], kb.to(q.dtype), vb.to(q.dtype),
                                           attn_mask=mask[:, None, None, :], scale=scale)
        return o[:, :, 0, :].reshape(B, q.shape[1], q.shape[2])


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list          # per layer (k_cache, v_cache)
    backend: AttentionBackend


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


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 scale: Optional[float] = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_idx = layer_idx
        self.scale = scale if scale is not None else head_dim ** -0.5

    def forward(self, q, k, v):
        """q [T, Hq, D], k/v [T, Hkv, D] (already normed and rotated) -> [T, Hq*D]."""
        ctx = get_forward_context()
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        out = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.attn_metadata, self.scale)
        return out.reshape(out.shape[0], -1)
