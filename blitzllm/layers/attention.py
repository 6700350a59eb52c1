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

    def forward(self, q, k, v, k_cache, v_cache, md, scale):
        write_kv_torch(k, v, k_cache, v_cache, md.slot_mapping)
        hq, hkv, d = q.shape[1], k_cache.shape[2], q.shape[2]
        group = hq // hkv
        if md.is_pure_decode:
            return self._decode(q, k_cache, v_cache, md, scale, group)
        out = torch.empty_like(q)
        start = 0
        for b, (ql, sl) in enumerate(zip(md.q_lens_host, md.seq_lens_host)):
            kb = _gather(k_cache, md.block_tables[b], sl).transpose(0, 1).to(q.dtype)  # [Hkv, L, D]
            vb = _gather(v_cache, md.block_tables[b], sl).transpose(0, 1).to(q.dtype)
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
