"""DeepSeek sparse attention (DeepSeek-V3.2): MLA in which each query token attends only to the
``index_topk`` cached tokens its lightning indexer (``layers/indexer.py``) scores highest, all
of them while its context holds no more. A layer's cache entry is (latents, indexer keys), two
paged tensors addressed by the same block table, so prefix caching, preemption and chunked
prefill keep them consistent. Knows nothing about the scheduler or the model.
"""
from __future__ import annotations

import torch

from ..distributed.parallel_state import get_tp_group
from ..kernels.attention.indexer import reference_indexer_logits
from ..kernels.attention.sparse_mla import reference_sparse_mla, sparse_mla
from ..kernels.attention.topk import reference_topk
from .attention import get_forward_context
from .indexer import Indexer, IndexerDims
from .mla import MLADims, MLAttention
from .parallel import Part, packed_column_linear
from .rotary import rotary_tables

LOGITS_BYTES = 1 << 28  # the most indexer logits one chunk of query rows holds


class SparseMLAttention(MLAttention):
    """Packed GEMMs: ``fused_qkv_a_proj`` = [q_a_proj, kv_a_proj_with_mqa, indexer.wk] (replicated)
    and ``fused_q_b_proj`` = [q_b_proj (heads split over tensor-parallel ranks), indexer.wq_b
    (replicated)]. Steps whose every row sees at most ``index_topk`` tokens run dense MLA
    (the same selection: all of them); others run indexer logits -> top-k -> sparse MLA, one
    query row per token (decode and prefill rows alike). ``shared`` (GLM-5's "shared" layers):
    no indexer; the layer attends to the tokens the last layer with one selected."""

    def __init__(self, d: MLADims, ix: IndexerDims, layer_idx: int, rotary, scale: float, shared: bool = False):
        if not d.q_lora_rank:
            raise ValueError("sparse attention needs q_lora_rank in config.json (its indexer reads the query latent)")
        if d.attention_bias:
            raise ValueError("sparse attention with attention_bias is not supported (the indexer's wk has no bias)")
        if ix.rope_dim != d.qk_rope_head_dim or ix.head_dim < ix.rope_dim:
            raise ValueError(f"index_head_dim ({ix.head_dim}) must hold the rope dims ({d.qk_rope_head_dim})")
        super().__init__(d, layer_idx, rotary, scale)
        tp = get_tp_group()
        self.ix = ix
        own = [] if shared else [ix.head_dim]  # the indexer's wk and wq_b shards
        self.fused_qkv_a_proj = packed_column_linear(d.hidden, [d.q_lora_rank, d.cache_dim, *own], tp,
                                                     parts=[None] * (2 + len(own)))
        del self.q_b_proj
        q_full = d.num_heads * d.qk_head_dim
        h0, h = tp.split(d.num_heads, "num_attention_heads")
        q_part = Part(0, h0 * d.qk_head_dim, h * d.qk_head_dim, q_full)
        self.fused_q_b_proj = packed_column_linear(d.q_lora_rank, [q_full] + [ix.n_heads * x for x in own], tp,
                                                   parts=[q_part] + [None] * len(own))
        self.indexer = None if shared else Indexer(ix, d.hidden)

    @staticmethod
    def packed_modules(d: MLADims) -> dict:
        return {**MLAttention.packed_modules(d), "wk": ("fused_qkv_a_proj", 2),
                "q_b_proj": ("fused_q_b_proj", 0), "wq_b": ("fused_q_b_proj", 1)}

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.fused_qkv_a_proj(x), x)

    def forward_norm(self, positions, x, residual, norm):
        """(attn(norm(x + residual)), x + residual); the indexer's head weights read the normed input."""
        if residual is None and norm.tp is None:
            h, residual = norm(x), x
        else:
            h, residual = norm(x, residual)
        return self.attend(positions, self.fused_qkv_a_proj(h), h), residual

    def _split_dsa(self, qkv_a: torch.Tensor) -> tuple:
        """-> (q [T, H, N + P] before rotary, kv_a [T, R + P], indexer q [T, Hi, D], indexer k [T, D]);
        a shared layer's indexer q and k: None."""
        d, ix, T = self.d, self.ix, qkv_a.shape[0]
        q_a, kv_a, k_idx = qkv_a.split([d.q_lora_rank, d.cache_dim, qkv_a.shape[1] - d.q_lora_rank - d.cache_dim], 1)
        qb = self.fused_q_b_proj(self.q_a_layernorm(q_a.contiguous()))
        nq = d.num_heads * d.qk_head_dim
        q = qb[:, :nq].view(T, d.num_heads, d.qk_head_dim)
        if self.indexer is None:
            return q, kv_a, None, None
        return q, kv_a, qb[:, nq:].view(T, ix.n_heads, ix.head_dim), k_idx

    def attend(self, positions: torch.Tensor, qkv_a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``fused_qkv_a_proj``'s output and its input h [T, hidden] -> [T, hidden]."""
        d, T = self.d, qkv_a.shape[0]
        q, kv_a, q_idx, k_idx = self._split_dsa(qkv_a)
        ctx = get_forward_context()
        md = ctx.attn_metadata
        cache, keys = ctx.kv_caches[self.layer_idx]
        q_pe = self._write_latents(positions, q, kv_a, cache, md)
        if self.indexer is not None:
            q_idx = self.indexer.prep(q_idx, k_idx, positions, self.rotary.cos_sin_cache, keys, md.slot_mapping)
        q_nope = q[..., :d.qk_nope_head_dim]
        if md.max_seq_len <= self.ix.topk:
            out = self._dense(q_nope, q_pe, cache, md)
        else:
            tables, lens = self._rows(positions, md, cache.shape[1])
            # rows in chunks whose logits [rows, context] stay within LOGITS_BYTES (a long prompt's prefill)
            step = max(1, LOGITS_BYTES // (4 * tables.shape[1] * cache.shape[1]))
            rows = [slice(r0, r0 + step) for r0 in range(0, T, step)]
            if self.indexer is not None:  # (kept for the shared layers after this one)
                ctx.scratch["dsa_picks"] = [self.indexer.select(q_idx[r], h[r], keys, tables[r], lens[r])
                                            for r in rows]
            parts = [self._sparse(q_nope[r], q_pe[r], cache, tables[r], idx)
                     for r, idx in zip(rows, ctx.scratch["dsa_picks"])]
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(out.reshape(T, d.num_heads * d.v_head_dim))

    def _sparse(self, q_nope, q_pe, cache, tables, idx) -> torch.Tensor:
        """Rows' attention over their selected latents ``idx`` -> [rows, H, V]."""
        q_latent = self.kv_b_proj.absorb_query(q_nope)
        return self.kv_b_proj.values(sparse_mla(q_latent.contiguous(), q_pe.contiguous(), cache, tables, idx,
                                                self.scale))

    @staticmethod
    def _rows(positions: torch.Tensor, md, block_size: int) -> tuple:
        """Per query row, its sequence's block table (columns up to the step's longest context)
        and its causal length (position + 1): (tables [T, W] int32, lens [T] int32). The same
        for every layer of a step: made once."""
        scratch = get_forward_context().scratch
        if "dsa_rows" not in scratch:
            tables = md.block_tables[:, :-(-md.max_seq_len // block_size)]
            if md.is_pure_decode:
                scratch["dsa_rows"] = (tables, md.seq_lens)
            else:
                dev = positions.device
                seq = torch.repeat_interleave(torch.arange(md.num_seqs, device=dev),
                                              torch.tensor(md.q_lens_host, device=dev))
                scratch["dsa_rows"] = (tables.index_select(0, seq), (positions + 1).to(torch.int32))
        return scratch["dsa_rows"]

    # ---- the MTP draft's torch path (spec/mtp.py), over its own dense entries ------------------
    def draft_entries(self, positions: torch.Tensor, x: torch.Tensor) -> tuple:
        """x [T, hidden] (normed) -> (q rows [T, H*(N+P) + Hi*D + Hi] fp32: the MLA query with its
        rope part rotated, the rotated indexer query and the head weights; entries [T, R + P + D]:
        the latent-cache entry and the indexer key), without the forward context."""
        T = x.shape[0]
        q, kv_a, q_idx, k_idx = self._split_dsa(self.fused_qkv_a_proj(x))
        q_pe, entry = self._rope_latent(q, kv_a, rotary_tables(self.rotary.cos_sin_cache, positions))
        q_idx, k_idx = self.indexer.qk(q_idx, k_idx, positions, self.rotary.cos_sin_cache)
        rows = [q[..., :self.d.qk_nope_head_dim], q_pe, q_idx, self.indexer.head_weights(x)]
        return torch.cat([r.reshape(T, -1).float() for r in rows], -1), torch.cat([entry, k_idx.to(entry.dtype)], -1)

    def draft_attend(self, q: torch.Tensor, kv: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
        """q rows of ``draft_entries`` at positions ``qpos`` over its entries kv [L, ...] of positions
        0..L-1 -> [Q, H, V] (before o_proj): each row over the top-k of its causal context."""
        d, ix = self.d, self.ix
        Q, L, H = q.shape[0], kv.shape[0], d.num_heads
        qn, qp, qi, w = q.split([H * d.qk_nope_head_dim, H * d.qk_rope_head_dim, ix.n_heads * ix.head_dim,
                                 ix.n_heads], -1)
        one = torch.zeros(Q, 1, dtype=torch.int32, device=q.device)  # every row's table: block 0 of L tokens
        lens = (qpos + 1).to(torch.int32)
        keys = kv[:, d.cache_dim:].reshape(1, L, 1, ix.head_dim)
        idx = reference_topk(reference_indexer_logits(qi.view(Q, ix.n_heads, ix.head_dim), w, keys, one, lens, L),
                             lens, ix.topk)
        q_latent = self.kv_b_proj.absorb_query(qn.view(Q, H, -1).to(kv.dtype))
        o = reference_sparse_mla(q_latent, qp.view(Q, H, -1).to(kv.dtype),
                                 kv[:, :d.cache_dim].reshape(1, L, 1, d.cache_dim), one, idx, self.scale)
        return self.kv_b_proj.values(o)
