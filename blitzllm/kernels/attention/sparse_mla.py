"""Sparse MLA (DeepSeek-V3.2): absorbed-form attention of each query row over only the latent
rows its top-k selection names, read through the row's block table from the paged latent
cache [NB, BS, 1, R + P]. Decode rows and prefill rows alike (a row is one query token):
``mla_decode.py``'s split kernel in its SPARSE form (the positions read from the row's index
list), its heuristic and its combine launch.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._common import next_pow2, use_triton
from .mla_decode import _launch


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


def sparse_mla_triton(q_latent, q_rope, cache, block_tables, indices, scale, config: Optional[dict] = None):
    """Same contract as reference_sparse_mla, with each row's selected positions first and its -1
    padding after (as ``topk`` returns them); ``config`` overrides mla_config's choices."""
    T, H, R = q_latent.shape
    P = q_rope.shape[2]
    K = indices.shape[1]
    assert cache.dim() == 4 and cache.shape[2] == 1 and cache.shape[3] == R + P and cache.stride(3) == 1
    assert q_rope.shape[:2] == (T, H) and indices.dtype == torch.int32 and indices.stride(1) == 1
    out = torch.empty_like(q_latent)
    if T == 0 or H == 0:
        return out
    counts = torch.empty(T, dtype=torch.int32, device=out.device)
    return _launch(q_latent, q_rope, cache, block_tables, counts, scale, out, K, config,
                   idx_ptr=indices, stride_idx=indices.stride(0), K=K, K_PAD=next_pow2(K), SPARSE=True)


def sparse_mla(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
               indices: torch.Tensor, scale: float) -> torch.Tensor:
    """See ``reference_sparse_mla``; the Triton split + combine kernels on CUDA (no host sync)."""
    fn = sparse_mla_triton if use_triton(q_latent) else reference_sparse_mla
    return fn(q_latent, q_rope, cache, block_tables, indices, scale)
