"""Multi-head latent attention (DeepSeek MLA) decode over the paged latent cache, in the
absorbed form: W_kv_b's key half is folded into the query and its value half applied to
the output by the caller, so attention reads only the cache.

Cache: [num_blocks, block_size, 1, R + P] per layer: the normalised compressed latent
(R = kv_lora_rank) then the rotated rope key (P = qk_rope_head_dim). This file holds the
torch reference; the Triton kernel sits next to it with the same signature.
"""
from __future__ import annotations

import torch


def reference_mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q_latent [B, H, R] (query already multiplied by W_kv_b's key part), q_rope [B, H, P],
    cache [NB, BS, 1, R + P], block_tables [B, W] int32, seq_lens [B] int32 (tokens to
    attend, this step's included) -> [B, H, R] in q_latent's dtype: softmax over
    scale * (q_latent . c + q_rope . k_rope) of the latents c, fp32 accumulation."""
    B, H, R = q_latent.shape
    bs = cache.shape[1]
    out = torch.empty_like(q_latent)
    for b in range(B):
        n = int(seq_lens[b])
        blocks = block_tables[b, :(n + bs - 1) // bs].long()
        kv = cache.index_select(0, blocks).flatten(0, 1)[:n, 0].float()   # [n, R + P]
        s = (q_latent[b].float() @ kv[:, :R].t() + q_rope[b].float() @ kv[:, R:].t()) * scale
        out[b] = (torch.softmax(s, dim=-1) @ kv[:, :R]).to(out.dtype)
    return out
