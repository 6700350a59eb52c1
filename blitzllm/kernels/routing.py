"""Expert selection inside a Triton program: a token's routing scores from its fp32 router
logits (softmax, or sigmoid with a correction bias steering the choice; grouped top-k over
n_group groups keeping topk_group), its top-k as TOP_K argmax rounds (``_select_row``: the
selection launches of kernels/moe.py; ``_route_entry``: the MoE gate/up launch choosing each
entry's expert itself, every warp on its own copy of the row), the weights renormalised and
scaled. Apart from kernels/moe.py so that kernels/fused_moe.py can use it too. The torch
form is ``moe.reference_select_experts``."""
from __future__ import annotations

from typing import Optional

import torch

from ._common import tl, triton


@triton.jit
def _route_scores(row_ptr, bias_ptr, R: tl.constexpr, GROUP: tl.constexpr, N_GROUP: tl.constexpr,
                  NG_PAD: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr,
                  HAS_BIAS: tl.constexpr):
    """One token's routing scores from its fp32 logits at row_ptr (read from L2: written by
    other programs or the launch before), as R equal rows [R, NG_PAD * G_PAD] (group-major):
    (choice: what the top-k ranks, the experts of groups not kept below every eligible one and
    padding at -inf; score: what the weights take). With R = the program's warps the compiler
    gives each warp a row, so every reduction along a row stays within a warp (shuffles, no
    shared memory or barrier); R = 1 in a one-warp launch."""
    rep = tl.arange(0, R)
    grp = tl.arange(0, NG_PAD)
    col = tl.arange(0, G_PAD)
    expert = grp[:, None] * GROUP + col[None, :]  # the row as [group, expert in group]
    valid = ((grp[:, None] < N_GROUP) & (col[None, :] < GROUP))[None, :, :] & (rep < R)[:, None, None]
    logit = tl.load(row_ptr + rep[:, None, None] * 0 + expert[None, :, :], mask=valid, other=float("-inf"),
                    cache_modifier=".cg")
    if SIGMOID:
        score = 1.0 / (1.0 + tl.exp(-logit))
    else:
        mx = tl.max(tl.max(logit, axis=2), axis=1)
        p = tl.exp(logit - mx[:, None, None])
        denom = tl.sum(tl.sum(p, axis=2), axis=1)
        score = p / denom[:, None, None]
    choice = score
    if HAS_BIAS:  # the correction bias steers the choice, not the weights
        choice = score + tl.load(bias_ptr + rep[:, None, None] * 0 + expert[None, :, :], mask=valid,
                                 other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if N_GROUP > 1:
        gscore = tl.max(choice, axis=2)  # [R, NG_PAD]
        if HAS_BIAS:  # a group scores the sum of its two best
            first = tl.argmax(choice, axis=2)
            gscore += tl.max(tl.where(col[None, None, :] == first[:, :, None], float("-inf"), choice), axis=2)
        gscore = tl.where(grp[None, :] < N_GROUP, gscore, float("-inf"))
        keep = (grp[None, :] < 0) & (rep[:, None] < R)
        for _ in tl.static_range(TOPK_GROUP):
            g = tl.argmax(gscore, axis=1)
            keep = keep | (grp[None, :] == g[:, None])
            gscore = tl.where(grp[None, :] == g[:, None], float("-inf"), gscore)
        # experts of the other groups rank below every eligible one (and above the padding)
        choice = tl.where(keep[:, :, None] | ~valid, choice, -3.4028234663852886e38)
    return (tl.reshape(choice, [R, NG_PAD * G_PAD]), tl.reshape(tl.where(valid, score, 0.0), [R, NG_PAD * G_PAD]))


@triton.jit
def _route_topk(row_ptr, bias_ptr, scaling, R: tl.constexpr, GROUP: tl.constexpr, N_GROUP: tl.constexpr,
                NG_PAD: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                K_PAD: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr):
    """One token's routing as R equal rows: (weights [R, K_PAD] fp32, expert ids [R, K_PAD]),
    TOP_K argmax rounds, best first, the lowest expert id among equals; entries past TOP_K 0."""
    flat, sflat = _route_scores(row_ptr, bias_ptr, R, GROUP, N_GROUP, NG_PAD, G_PAD, TOPK_GROUP, SIGMOID, HAS_BIAS)
    pos = tl.arange(0, NG_PAD * G_PAD)
    k = tl.arange(0, K_PAD)
    # the chosen experts' scores are gathered from registers (no second read of the logits):
    # with one row after the rounds, all at once; with a row per warp in each round (a gather
    # [R, K_PAD, positions] would reduce across warps)
    ids = tl.zeros([R, K_PAD], dtype=tl.int32)
    picks = tl.full([R, K_PAD], -1, dtype=tl.int32)  # positions in flat of the chosen experts
    w = tl.zeros([R, K_PAD], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        f = tl.argmax(flat, axis=1)  # [R]: the position of choice i
        hit = pos[None, :] == f[:, None]
        ids = tl.where(k[None, :] == i, ((f // G_PAD) * GROUP + f % G_PAD)[:, None], ids)
        if R == 1:
            picks = tl.where(k[None, :] == i, f[:, None], picks)
        else:
            w = tl.where(k[None, :] == i, tl.sum(tl.where(hit, sflat, 0.0), axis=1)[:, None], w)
        flat = tl.where(hit, float("-inf"), flat)
    if R == 1:
        w = tl.sum(tl.where(pos[None, None, :] == picks[:, :, None], sflat[:, None, :], 0.0), axis=2)
    if RENORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    return w * scaling, ids


@triton.jit
def _select_row(row_ptr, bias_ptr, w_out_ptr, id_out_ptr, row, scaling,
                GROUP: tl.constexpr, N_GROUP: tl.constexpr, NG_PAD: tl.constexpr,
                G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                K_PAD: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                RENORM: tl.constexpr, R: tl.constexpr = 1):
    """Routing of one token from its fp32 logits at row_ptr: writes its TOP_K weights and
    expert ids to row ``row`` of the outputs. R: copies of the row (the program's warps: each
    warp chooses on its own; 1 for a one-warp launch); the first copy is stored."""
    w, ids = _route_topk(row_ptr, bias_ptr, scaling, R, GROUP, N_GROUP, NG_PAD, G_PAD, TOPK_GROUP, TOP_K, K_PAD,
                         SIGMOID, HAS_BIAS, RENORM)
    if R == 1:
        k = tl.arange(0, K_PAD)
        tl.store(w_out_ptr + row * TOP_K + k, tl.reshape(w, [K_PAD]), mask=k < TOP_K)
        tl.store(id_out_ptr + row * TOP_K + k, tl.reshape(ids, [K_PAD]), mask=k < TOP_K)
    else:
        rep = tl.arange(0, R)[:, None]
        k2 = tl.arange(0, K_PAD)[None, :]
        kmask = (k2 < TOP_K) & (rep == 0)
        tl.store(w_out_ptr + row * TOP_K + rep * 0 + k2, w, mask=kmask)
        tl.store(id_out_ptr + row * TOP_K + rep * 0 + k2, ids, mask=kmask)


@triton.jit
def _route_entry(row_ptr, bias_ptr, kk, scaling, R: tl.constexpr,
                 GROUP: tl.constexpr, N_GROUP: tl.constexpr, NG_PAD: tl.constexpr,
                 G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                 K_PAD: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                 RENORM: tl.constexpr):
    """``_select_row``'s choice kk of one token, (weight, expert id) as scalars, for launches
    that route inside each program (the MoE gate/up): R = the program's warps, each warp
    choosing on its own row (no barrier until the one reduction across rows at the end)."""
    w, ids = _route_topk(row_ptr, bias_ptr, scaling, R, GROUP, N_GROUP, NG_PAD, G_PAD, TOPK_GROUP, TOP_K, K_PAD,
                         SIGMOID, HAS_BIAS, RENORM)
    sel = tl.arange(0, K_PAD)[None, :] == kk
    return tl.max(tl.sum(tl.where(sel, w, 0.0), axis=1), axis=0), tl.max(tl.sum(tl.where(sel, ids, 0), axis=1), axis=0)


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
