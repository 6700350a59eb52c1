"""Expert selection inside a Triton program: a token's routing scores from its fp32 router
logits (softmax, or sigmoid with a correction bias steering the choice; grouped top-k over
n_group groups keeping topk_group), its top-k as TOP_K argmax rounds (``_select_row``: the
selection launches of kernels/moe/router.py), the weights renormalised and scaled, and with
SHARED_GATE a gated shared expert stacked as expert E as one more entry. The torch form
is ``moe.reference_select_experts``."""
from __future__ import annotations

from typing import Optional

import torch

from .._common import tl, triton


@triton.jit
def _route_scores(row_ptr, bias_ptr, GROUP: tl.constexpr, N_GROUP: tl.constexpr, NG_PAD: tl.constexpr,
                  G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One token's routing scores from its fp32 logits at row_ptr (from L2), flat [NG_PAD * G_PAD]
    group-major: (choice, which the top-k ranks: experts of groups not kept below every eligible
    one, padding -inf; score, which the weights take; each position's expert id)."""
    grp = tl.arange(0, NG_PAD)
    col = tl.arange(0, G_PAD)
    expert = grp[:, None] * GROUP + col[None, :]  # the row as [group, expert in group]
    valid = (grp[:, None] < N_GROUP) & (col[None, :] < GROUP)
    logit = tl.load(row_ptr + expert, mask=valid, other=float("-inf"), cache_modifier=".cg")
    if SIGMOID:
        score = 1.0 / (1.0 + tl.exp(-logit))
    else:
        mx = tl.max(tl.max(logit, axis=1), axis=0)
        p = tl.exp(logit - mx)
        denom = tl.sum(tl.sum(p, axis=1), axis=0)
        score = p / denom
    choice = score
    if HAS_BIAS:  # the correction bias steers the choice, not the weights
        choice = score + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if N_GROUP > 1:
        gscore = tl.max(choice, axis=1)
        if HAS_BIAS:  # a group scores the sum of its two best
            first = tl.argmax(choice, axis=1)
            gscore += tl.max(tl.where(col[None, :] == first[:, None], float("-inf"), choice), axis=1)
        gscore = tl.where(grp < N_GROUP, gscore, float("-inf"))
        keep = grp < 0
        for _ in tl.static_range(TOPK_GROUP):
            g = tl.argmax(gscore, axis=0)
            keep = keep | (grp == g)
            gscore = tl.where(grp == g, float("-inf"), gscore)
        # experts of the other groups rank below every eligible one (and above the padding)
        choice = tl.where(keep[:, None] | ~valid, choice, -3.4028234663852886e38)
    return (tl.reshape(choice, [NG_PAD * G_PAD]), tl.reshape(tl.where(valid, score, 0.0), [NG_PAD * G_PAD]),
            tl.reshape(expert, [NG_PAD * G_PAD]))


@triton.jit
def _route_weights(w, scaling, RENORM: tl.constexpr):
    if RENORM:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    return w * scaling


@triton.jit
def _select_row(row_ptr, bias_ptr, w_out_ptr, id_out_ptr, row, scaling,
                GROUP: tl.constexpr, N_GROUP: tl.constexpr, NG_PAD: tl.constexpr,
                G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                K_PAD: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                RENORM: tl.constexpr, SHARED_GATE: tl.constexpr = False):
    """Routing of one token from its fp32 logits at row_ptr: writes its TOP_K weights and
    expert ids to row ``row`` of the outputs (TOP_K argmax rounds, best first; the lowest
    expert id among equals). SHARED_GATE: the logits have a column E more, the gate of a shared
    expert stacked as expert E, whose entry (id E, weight sigmoid(logit E)) follows: rows of
    TOP_K + 1."""
    flat, sflat, eid = _route_scores(row_ptr, bias_ptr, GROUP, N_GROUP, NG_PAD, G_PAD, TOPK_GROUP, SIGMOID, HAS_BIAS)
    pos = tl.arange(0, NG_PAD * G_PAD)
    k = tl.arange(0, K_PAD)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    picks = tl.full([K_PAD], -1, dtype=tl.int32)  # positions in flat of the chosen experts
    for i in tl.static_range(TOP_K):
        f = tl.argmax(flat, axis=0)
        ids = tl.where(k == i, (f // G_PAD) * GROUP + f % G_PAD, ids)
        picks = tl.where(k == i, f, picks)
        flat = tl.where(pos == f, float("-inf"), flat)
    kmask = k < TOP_K
    # the chosen experts' scores gathered from registers (no second read of the logits)
    w = tl.sum(tl.where(pos[None, :] == picks[:, None], sflat[None, :], 0.0), axis=1)
    w = _route_weights(w, scaling, RENORM)
    out_k: tl.constexpr = TOP_K + SHARED_GATE
    tl.store(w_out_ptr + row * out_k + k, w, mask=kmask)
    tl.store(id_out_ptr + row * out_k + k, ids, mask=kmask)
    if SHARED_GATE:
        e: tl.constexpr = N_GROUP * GROUP
        tl.store(w_out_ptr + row * out_k + TOP_K, 1.0 / (1.0 + tl.exp(-tl.load(row_ptr + e))))
        tl.store(id_out_ptr + row * out_k + TOP_K, e)


def check_routing(num_experts: int, top_k: int, scoring: str, bias: Optional[torch.Tensor],
                  n_group: int, topk_group: int) -> None:
    """ValueError naming the argument when the routing settings do not fit E experts."""
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group must be >= 1 and divide the {num_experts} experts, got {n_group}")
    if n_group > 1 and not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    if n_group > 1 and bias is not None and num_experts // n_group < 2:
        raise ValueError("grouped top-k with a bias needs at least 2 experts per group")
    if bias is not None and bias.shape != (num_experts,):
        raise ValueError(f"bias must have shape ({num_experts},), got {tuple(bias.shape)}")
