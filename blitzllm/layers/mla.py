"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over the paged latent cache [NB, BS, 1, R + P]
(normalised latent, rotated rope key). Pure decode runs the absorbed form
(``kernels/attention/mla_decode.py``); prefill and mixed steps expand each sequence's latents
to per-head keys and values. Knows nothing about the scheduler or the model.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from .parallel import Part, column_linear, packed_column_linear, row_linear, shard_rows
from ..distributed.parallel_state import get_tp_group
from ..kernels.attention import mla_decode as mla_ops
from ..kernels._common import use_triton
from ..kernels.attention.kv_store import copy_rows
from .attention import _gather, get_forward_context, step_rotary_tables
from .norm import RMSNorm
from .rotary import apply_rotary_tables, rotary_tables, yarn_mscale

# the dispatcher (Triton on CUDA) when kernels/attention/mla_decode.py has one, else the torch reference
_mla_decode = getattr(mla_ops, "mla_decode", mla_ops.reference_mla_decode)

_SCORE_ELEMS = 1 << 26  # the most attention scores the expanded (prefill) path holds at once
_LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with the default eps


@dataclass(frozen=True)
class MLADims:
    hidden: int
    num_heads: int
    q_lora_rank: Optional[int]   # None: a full-rank q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # rope dims come in (x0, x1) pairs (DeepSeek); False: rotate-half
    attention_bias: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def softmax_scale(self, rope_scaling: Optional[dict]) -> float:
        """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when the rope
        scaling sets mscale_all_dim (transformers' ``yarn_apply_mscale``)."""
        scale = self.qk_head_dim ** -0.5
        if rope_scaling and rope_scaling.get("mscale_all_dim"):
            scale *= yarn_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"]) ** 2
        return scale


def rotate_rope(x: torch.Tensor, tables, interleave: bool) -> torch.Tensor:
    """Rotate x [T, heads, P] (q's heads, then the shared k) with rotary ``tables``; interleaved
    pairs come out rotate-half style, the order transformers' interleaved rope returns."""
    if interleave:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], -1)
    return apply_rotary_tables(x, *tables)


class LatentUpProjection(nn.Module):
    """``kv_b_proj``: latent [.., R] -> per head (k_nope, v); a plain weight, not a ``Linear``, as
    the absorbed decode reads its halves as matrices (weight casts and int4 packing skip it)."""

    def __init__(self, d: MLADims):
        super().__init__()
        self.d = d
        self.weight = nn.Parameter(torch.empty(d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank))

    def _halves(self):
        d = self.d
        w = self.weight.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
        return w[:, :d.qk_nope_head_dim], w[:, d.qk_nope_head_dim:]  # W_uk [H, N, R], W_uv [H, V, R]

    def expand(self, latent: torch.Tensor):
        """latent [L, R] -> (k_nope [L, H, N], v [L, H, V])."""
        d = self.d
        kv = nn.functional.linear(latent, self.weight).view(-1, d.num_heads, d.qk_nope_head_dim + d.v_head_dim)
        return kv[..., :d.qk_nope_head_dim], kv[..., d.qk_nope_head_dim:]

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [B, H, N] -> q_nope W_uk, [B, H, R]: the query in latent space."""
        return torch.bmm(q_nope.transpose(0, 1), self._halves()[0]).transpose(0, 1)

    def values(self, o_latent: torch.Tensor) -> torch.Tensor:
        """o_latent [B, H, R] -> [B, H, V]: the attention output through W_uv."""
        return torch.bmm(o_latent.transpose(0, 1), self._halves()[1].transpose(1, 2)).transpose(0, 1)


def write_latent_cache(entry: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, padded: bool):
    """entry [T, R + P] into cache [NB, BS, 1, R + P] at ``slot_mapping`` (negative: skip), with no
    host sync: a padding row repeats the write of the real row with the highest slot (all
    padding, as in graph capture: slot 0 takes a junk write)."""
    if padded:
        keep = slot_mapping >= 0
        j = slot_mapping.argmax().view(1)  # index_select, not [j]: a 0-dim index reads it on the host
        slot_mapping = torch.where(keep, slot_mapping, slot_mapping.index_select(0, j).clamp(min=0))
        entry = torch.where(keep[:, None], entry, entry.index_select(0, j))
    copy_rows(cache.view(-1, cache.shape[-1]), slot_mapping, entry)


class MLAttention(nn.Module):
    """Checkpoint names as HF; ``q_a_proj`` (or ``q_proj``) and ``kv_a_proj_with_mqa`` read the same
    input, so they are packed into one GEMM, ``fused_qkv_a_proj``. Tensor parallel: heads split,
    the latent projections and cache replicated (every rank computes the same latent)."""

    def __init__(self, d: MLADims, layer_idx: int, rotary, scale: float):
        super().__init__()
        if not d.q_lora_rank and d.attention_bias:
            raise ValueError("attention_bias with q_lora_rank=null is not supported (q_proj has no bias "
                             "but kv_a_proj_with_mqa has one, so they cannot share a packed GEMM)")
        tp = get_tp_group()
        H = d.num_heads
        h0, h = tp.split(H, "num_attention_heads")
        d = replace(d, num_heads=h)  # this rank's heads
        self.d, self.layer_idx, self.rotary, self.scale = d, layer_idx, rotary, scale
        q_full = H * d.qk_head_dim
        q_part = None if d.q_lora_rank else Part(0, h0 * d.qk_head_dim, h * d.qk_head_dim, q_full)
        self.fused_qkv_a_proj = packed_column_linear(d.hidden, [d.q_lora_rank or q_full, d.cache_dim], tp,
                                                     d.attention_bias, parts=[q_part, None])
        if d.q_lora_rank:
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = column_linear(d.q_lora_rank, q_full, tp)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, _LATENT_NORM_EPS)
        per_head = d.qk_nope_head_dim + d.v_head_dim
        self.kv_b_proj = shard_rows(LatentUpProjection(d),
                                    Part(0, h0 * per_head, h * per_head, H * per_head) if tp.world_size > 1 else None)
        self.o_proj = row_linear(H * d.v_head_dim, d.hidden, tp, d.attention_bias)

    @staticmethod
    def packed_modules(d: MLADims) -> dict:
        first = "q_a_proj" if d.q_lora_rank else "q_proj"
        return {first: ("fused_qkv_a_proj", 0), "kv_a_proj_with_mqa": ("fused_qkv_a_proj", 1)}

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.fused_qkv_a_proj(x))

    def forward_norm(self, positions, x, residual, norm):
        """Pre-norm entry, as ``Linear.forward_norm``: (attn(norm(x + residual)), x + residual)."""
        qkv_a, residual = self.fused_qkv_a_proj.forward_norm(x, residual, norm)
        return self.attend(positions, qkv_a), residual

    def _split(self, qkv_a: torch.Tensor) -> tuple:
        """Output of ``fused_qkv_a_proj`` -> (q [T, H, N + P] before rotary, kv_a [T, R + P])."""
        d = self.d
        q, kv_a = qkv_a.split([qkv_a.shape[1] - d.cache_dim, d.cache_dim], dim=1)
        if d.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q.contiguous()))
        return q.view(qkv_a.shape[0], d.num_heads, d.qk_head_dim), kv_a

    def _rope_latent(self, q: torch.Tensor, kv_a: torch.Tensor, tables) -> tuple:
        """(q's rotated rope part [T, H, P], the latent-cache entries [T, R + P]: the
        normalised latent and the rotated rope key) with rotary ``tables``."""
        d = self.d
        latent = self.kv_a_layernorm(kv_a[:, :d.kv_lora_rank].contiguous())
        pe = rotate_rope(torch.cat([q[..., d.qk_nope_head_dim:], kv_a[:, None, d.kv_lora_rank:]], 1), tables,
                         d.rope_interleave)
        return pe[:, :-1], torch.cat([latent, pe[:, -1]], -1)

    def latent_qkv(self, positions: torch.Tensor, x: torch.Tensor) -> tuple:
        """x [T, hidden] -> (q [T, H, N + P], rope part rotated; latent-cache entries [T, R + P]) in
        torch, without the forward context: for the MTP draft layer's own dense latents."""
        q, kv_a = self._split(self.fused_qkv_a_proj(x))
        q_pe, entry = self._rope_latent(q, kv_a, rotary_tables(self.rotary.cos_sin_cache, positions))
        return torch.cat([q[..., :self.d.qk_nope_head_dim], q_pe], -1), entry

    def _expand(self, kv: torch.Tensor) -> tuple:
        """Entries kv [L, R + P] -> (keys [L, H, N + P], values [L, H, V]) per head."""
        d = self.d
        k_nope, v = self.kv_b_proj.expand(kv[:, :d.kv_lora_rank])
        return torch.cat([k_nope, kv[:, None, d.kv_lora_rank:].expand(-1, d.num_heads, -1)], -1), v

    def attend_latents(self, q: torch.Tensor, kv: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
        """q [Q, H, N + P] at positions ``qpos`` over the entries kv [L, R + P] of positions
        0..L-1, causal, latents expanded per head -> [Q, H, V] (before o_proj). The torch
        reference: scores materialised, in query-row chunks."""
        k, v = self._expand(kv)
        k, v, cols = k.permute(1, 2, 0), v.transpose(0, 1), torch.arange(kv.shape[0], device=q.device)
        # query rows in chunks: the scores [H, rows, L] of a whole long prompt would not fit (a
        # 32K-token prompt's at 128 heads: 256 GB in bf16)
        step = max(1, _SCORE_ELEMS // (self.d.num_heads * kv.shape[0]))
        out = []
        for r0 in range(0, q.shape[0], step):
            s = torch.matmul(q[r0:r0 + step].transpose(0, 1), k).float() * self.scale
            s = s.masked_fill(cols[None, :] > qpos[r0:r0 + step, None], float("-inf"))
            out.append(torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v).transpose(0, 1))
        return out[0] if len(out) == 1 else torch.cat(out)

    def attend_fused(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """``attend_latents`` for the last Q positions of the L entries (a prefill chunk), in one
        fused attention call (torch's flash / memory-efficient SDPA): the scores are never
        materialised, which the row chunks above pay for at every long prompt."""
        k, v = self._expand(kv)
        Q, L = q.shape[0], kv.shape[0]
        if Q < L:
            # a chunk after earlier context: flash attention aligns its causal mask to the last
            # row itself but wants v's head dim equal to q's; unpadded, the shifted mask goes to
            # the memory-efficient kernel, about half as fast here (benchmarks/mla_prefill.py)
            v = nn.functional.pad(v, (0, k.shape[-1] - v.shape[-1]))
        o = nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=causal_lower_right(Q, L), scale=self.scale)
        return o[0].transpose(0, 1)[..., :self.d.v_head_dim]

    # what an MTP draft layer (spec/mtp.py) runs over its own dense entries
    draft_entries = latent_qkv
    draft_attend = attend_latents

    def attend(self, positions: torch.Tensor, qkv_a: torch.Tensor) -> torch.Tensor:
        """Output of ``fused_qkv_a_proj`` [T, first + R + P] -> [T, hidden]."""
        d, T = self.d, qkv_a.shape[0]
        q, kv_a = self._split(qkv_a)
        ctx = get_forward_context()
        cache, md = ctx.kv_caches[self.layer_idx][0], ctx.attn_metadata
        q_pe = self._write_latents(positions, q, kv_a, cache, md)
        out = self._dense(q[..., :d.qk_nope_head_dim], q_pe, cache, md)
        return self.o_proj(out.reshape(T, d.num_heads * d.v_head_dim))

    def _write_latents(self, positions, q, kv_a, cache, md) -> torch.Tensor:
        """Write this step's latent-cache entries; returns q's rotated rope part [T, H, P]."""
        d = self.d
        if use_triton(q):  # latent norm + rotary + cache write in one launch, not a dozen torch ops
            from ..kernels.attention.mla_prep import mla_prep_triton
            norm = self.kv_a_layernorm
            return mla_prep_triton(q, kv_a, positions, self.rotary.cos_sin_cache, norm.weight, norm.eps, cache,
                                   md.slot_mapping, d.qk_nope_head_dim, d.rope_interleave)
        q_pe, entry = self._rope_latent(q, kv_a, step_rotary_tables(self.rotary, positions))
        write_latent_cache(entry, cache, md.slot_mapping, md.padded)
        return q_pe

    def _dense(self, q_nope, q_pe, cache, md) -> torch.Tensor:
        """Attention of every row over all its cached context -> [T, H, V]: absorbed for pure
        decode, latents expanded per head otherwise."""
        if not md.is_pure_decode:
            return self._prefill(torch.cat([q_nope, q_pe], -1), cache, md)
        q_latent = self.kv_b_proj.absorb_query(q_nope)
        o_latent = _mla_decode(q_latent.contiguous(), q_pe.contiguous(), cache, md.block_tables,
                               md.seq_lens, self.scale)
        return self.kv_b_proj.values(o_latent)

    def _prefill(self, q: torch.Tensor, cache: torch.Tensor, md) -> torch.Tensor:
        """q [T, H, N + P] -> [T, H, V]: causal attention per sequence over its whole cached
        context (earlier chunks and prefix-cache hits included), latents expanded per head."""
        d = self.d
        out = q.new_empty(q.shape[0], d.num_heads, d.v_head_dim)
        start = 0
        for b, (ql, sl) in enumerate(zip(md.q_lens_host, md.seq_lens_host)):
            kv = _gather(cache, md.block_tables[b], sl)[:, 0].to(q.dtype)  # [L, R + P]
            rows = q[start:start + ql]
            out[start:start + ql] = self.attend_fused(rows, kv) if use_triton(q) else \
                self.attend_latents(rows, kv, torch.arange(sl - ql, sl, device=q.device))
            start += ql
        return out
