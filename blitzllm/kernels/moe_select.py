"""Expert selection of one token in registers (``select_topk``): softmax or sigmoid scores,
the optional correction bias steering the choice, grouped top-k, renormalisation and scaling.
Shared by the selection kernel (``moe.select_experts_triton``), the routing fused into the
router launches, and the fused MoE's gate/up launch that routes its token itself; the torch
reference is ``moe.reference_select_experts``."""
from ._common import tl, triton


@triton.jit
def select_topk(row_ptr, bias_ptr, scaling,
                GROUP: tl.constexpr, N_GROUP: tl.constexpr, NG_PAD: tl.constexpr,
                G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                K_PAD: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                RENORM: tl.constexpr):
    """The routing of one token from its fp32 logits at row_ptr, in registers: (expert ids
    [K_PAD] int32, weights [K_PAD] fp32), best first, entries past TOP_K undefined. Also
    called by the fused MoE's gate/up launch, each program routing its token itself."""
    grp = tl.arange(0, NG_PAD)
    col = tl.arange(0, G_PAD)
    expert = grp[:, None] * GROUP + col[None, :]  # the row as [group, expert in group]
    valid = (grp[:, None] < N_GROUP) & (col[None, :] < GROUP)
    logit = tl.load(row_ptr + expert, mask=valid, other=float("-inf"), cache_modifier=".cg")
    mx = 0.0
    denom = 1.0
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
    flat = tl.reshape(choice, [NG_PAD * G_PAD])
    pos = tl.arange(0, NG_PAD * G_PAD)
    k = tl.arange(0, K_PAD)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    picks = tl.full([K_PAD], -1, dtype=tl.int32)  # positions in flat of the chosen experts
    for i in tl.static_range(TOP_K):  # best first; the lowest expert id among equals
        f = tl.argmax(flat, axis=0)
        ids = tl.where(k == i, (f // G_PAD) * GROUP + f % G_PAD, ids)
        picks = tl.where(k == i, f, picks)
        flat = tl.where(pos == f, float("-inf"), flat)
    # the chosen experts' scores gathered from registers (no second read of the logits)
    sflat = tl.reshape(tl.where(valid, score, 0.0), [NG_PAD * G_PAD])
    w = tl.sum(tl.where(pos[None, :] == picks[:, None], sflat[None, :], 0.0), axis=1)
    if RENORM:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    w = w * scaling
    return ids, w
