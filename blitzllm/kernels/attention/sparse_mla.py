"""Sparse MLA (DeepSeek-V3.2): absorbed-form attention of each query row over only the latent
rows its top-k selection names, read through the row's block table from the paged latent
cache [NB, BS, 1, R + P]. Decode rows and prefill rows alike (a row is one query token).
"""
from __future__ import annotations

import torch


ROW_CHUNK = 32  # query rows per step of the torch reference (bounds its gathered latents)


def reference_sparse_mla(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                         block_tables: torch.Tensor, indices: torch.Tensor, scale: float) -> torch.Tensor:
    """q_latent [T, H, R] (q_nope W_uk), q_rope [T, H, P], cache [NB, BS, 1, R + P],
    block_tables [T, W] int32 (each row's sequence table), indices [T, K] int32 (positions in
    that sequence, -1: none; every row names at least one) -> [T, H, R] in q_latent's dtype:
    softmax over scale * (q_latent . c + q_rope . k_rope) of the named latents c, fp32 math."""
    T, H, R = q_latent.shape
    bs, E = cache.shape[1], cache.shape[-1]
    flat = cache.view(-1, E)
    out = torch.empty_like(q_latent)
    for r0 in range(0, T, ROW_CHUNK):
        r1 = min(T, r0 + ROW_CHUNK)
        idx = indices[r0:r1].long()
        ok = idx >= 0
        pos = idx.clamp(min=0)
        slots = block_tables[r0:r1].long().gather(1, pos // bs) * bs + pos % bs
        kv = flat[slots].float()                                              # [t, K, R + P]
        s = (torch.einsum("thr,tkr->thk", q_latent[r0:r1].float(), kv[..., :R])
             + torch.einsum("thp,tkp->thk", q_rope[r0:r1].float(), kv[..., R:])) * scale
        p = torch.softmax(s.masked_fill(~ok[:, None, :], float("-inf")), dim=-1)
        out[r0:r1] = torch.einsum("thk,tkr->thr", p, kv[..., :R]).to(out.dtype)
    return out


def sparse_mla(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
               indices: torch.Tensor, scale: float) -> torch.Tensor:
    """See ``reference_sparse_mla`` (the Triton kernels are not written yet: torch everywhere)."""
    return reference_sparse_mla(q_latent, q_rope, cache, block_tables, indices, scale)
