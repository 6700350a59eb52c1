"""Mixture-of-experts ops: router GEMM (fp32 logits), expert selection (softmax or
sigmoid+bias scoring, grouped top-k, renormalise, scale) and the expert computation.

This file holds the plain-torch references the model layers use off-GPU; the Triton
kernels (router GEMM, fused routing, fused grouped MoE) sit next to them with the same
signatures. Nothing here knows about models or checkpoints.

Shapes: x [T, H]; router weight [E, H]; w13 [E, 2I, H] (gate rows then up rows);
w2 [E, H, I]; topk weights [T, K] fp32; topk ids [T, K] int32.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def reference_router_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Router logits in fp32: [T, H] x [E, H]^T -> [T, E] (inputs widened, fp32 accumulate)."""
    return x.float() @ weight.float().t()


def reference_select_experts(logits: torch.Tensor, top_k: int, scoring: str = "softmax",
                             bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
                             renormalize: bool = True, scaling: float = 1.0):
    """logits [T, E] (fp32) -> (weights [T, K] fp32, ids [T, K] int32).

    scoring: "softmax" (Qwen3-MoE) or "sigmoid" (DeepSeek-V3, MiniMax-M2). ``bias`` (the
    e_score_correction_bias) is added to the scores for *selection* only; the weights come
    from the unbiased scores. With n_group > 1 (DeepSeek grouped top-k) experts are split
    into n_group groups, each group scored by the sum of its top-2 biased scores (its max
    when there is no bias), and only experts of the best topk_group groups are eligible.
    ``renormalize`` divides the K weights by their sum; ``scaling`` multiplies them
    (routed_scaling_factor)."""
    if scoring == "softmax":
        scores = torch.softmax(logits.float(), dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits.float())
    else:
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    choice = scores + bias.float() if bias is not None else scores
    if n_group > 1:
        T, E = choice.shape
        groups = choice.view(T, n_group, E // n_group)
        if bias is not None:
            gscore = groups.topk(2, dim=-1).values.sum(-1)
        else:
            gscore = groups.max(dim=-1).values
        keep = gscore.topk(topk_group, dim=-1).indices
        gmask = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~gmask.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if scaling != 1.0:
        weights = weights * scaling
    return weights, ids.to(torch.int32)


def reference_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k weight[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, k]; [T, H] in
    x's dtype. Each expert's output is rounded to x's dtype before the weighted sum (as
    transformers does), the sum is accumulated in fp32."""
    T, H = x.shape
    inter = w2.shape[2]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    for e in torch.unique(flat_ids).tolist():
        rows = (flat_ids == e).nonzero().squeeze(1)
        tok = rows // topk_ids.shape[1]
        h = x[tok] @ w13[e].t()
        a = (F.silu(h[:, :inter].float()).to(x.dtype) * h[:, inter:])
        y = (a @ w2[e].t()).to(x.dtype)
        out.index_add_(0, tok, y.float() * topk_weights.reshape(-1)[rows, None].float())
    return out.to(x.dtype)
