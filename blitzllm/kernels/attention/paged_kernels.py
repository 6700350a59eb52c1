"""The Triton kernels of attention over the paged KV cache (launchers: ``paged.py``). GQA packs
the Hq // Hkv query heads of a kv head into one tile's rows, so each K/V tile is read once per
kv head; scores and softmax statistics in fp32 (exp2, scale folded in), the probabilities cast
to q's dtype for P @ V, as flash attention does. An fp8 cache's tiles are widened to q's dtype as
they load; entries are written through ``kv_store.store_cast``.
"""
from .._common import pdl_launch_dependents, pdl_wait, tl, triton
from .kv_store import store_cast
from .qk_norm_rope_cache import _norm_rope_apply, _norm_rope_params


@triton.jit
def _attn_scores(m_i, l_i, q, k, keep, qk_scale, IEEE: tl.constexpr):
    """Online-softmax statistics of one key tile: returns (p, alpha, m_new, l_new). An fp8 cache's
    keys are widened to q's dtype here."""
    k = k.to(q.dtype)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(keep, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _attn_pv(acc, alpha, p, v, IEEE: tl.constexpr):
    if IEEE:
        return acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _kv_tile_offsets(bt_ptr, offs_n, valid, stride_b, stride_t, offs_d, BLOCK_SIZE: tl.constexpr):
    """Cache offsets [BLOCK_N, D_PAD] of keys offs_n (through the block table)."""
    blk = tl.load(bt_ptr + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return (blk * stride_b + (offs_n % BLOCK_SIZE) * stride_t)[:, None] + offs_d[None, :]


@triton.jit
def _attn_tile(
    acc, m_i, l_i, q, k_ptr, v_ptr, bt_ptr, start_n, kv_end, q_pos, qk_scale,
    stride_kb, stride_kt, stride_vb, stride_vt, offs_d, dmask,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, EARLY_V: tl.constexpr,
):
    """One online-softmax step over keys [start_n, start_n + BLOCK_N) (< kv_end).
    qk_scale is scale * log2(e); q_pos [M] are the rows' positions (if CAUSAL)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    valid = offs_n < kv_end
    blk = tl.load(bt_ptr + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    tok = offs_n % BLOCK_SIZE
    kmask = valid[:, None] & dmask[None, :]
    k = tl.load(k_ptr + (blk * stride_kb + tok * stride_kt)[:, None] + offs_d[None, :],
                mask=kmask, other=0.0)
    v_off = (blk * stride_vb + tok * stride_vt)[:, None] + offs_d[None, :]
    if EARLY_V:  # issue the V load before the softmax: shorter latency chain (decode)
        v = tl.load(v_ptr + v_off, mask=kmask, other=0.0)
    keep = valid[None, :]
    if CAUSAL:
        keep = keep & (offs_n[None, :] <= q_pos[:, None])
    p, alpha, m_new, l_i = _attn_scores(m_i, l_i, q, k, keep, qk_scale, IEEE)
    if not EARLY_V:
        v = tl.load(v_ptr + v_off, mask=kmask, other=0.0)
    return _attn_pv(acc, alpha, p, v.to(q.dtype), IEEE), m_new, l_i


@triton.jit
def _combine_splits(m_ptr, l_ptr, acc_ptr, out_ptr, b, head0, G, n_active, base, stride_ob, stride_oh,
                    NUM_SPLITS: tl.constexpr, G_COMB: tl.constexpr, COMBINE: tl.constexpr,
                    D: tl.constexpr, D_PAD: tl.constexpr):
    """Merge the first n_active split partials of query heads [head0, head0 + G) (rows
    base + g * NUM_SPLITS + split) and write the output: COMBINE splits per round, their
    loads issued together ([G_COMB, COMBINE, D_PAD] tiles from L2)."""
    offs_g = tl.arange(0, G_COMB)
    offs_s = tl.arange(0, COMBINE)
    offs_d = tl.arange(0, D_PAD)
    gmask = offs_g < G
    m_all = tl.full([G_COMB], -1.0e30, dtype=tl.float32)
    l_all = tl.zeros([G_COMB], dtype=tl.float32)
    o_all = tl.zeros([G_COMB, D_PAD], dtype=tl.float32)
    for s0 in range(0, n_active, COMBINE):
        rows = base + offs_g[:, None] * NUM_SPLITS + s0 + offs_s[None, :]   # [G_COMB, COMBINE]
        ok = gmask[:, None] & ((s0 + offs_s) < n_active)[None, :]
        m_s = tl.load(m_ptr + rows, mask=ok, other=-1.0e30, cache_modifier=".cg")
        l_s = tl.load(l_ptr + rows, mask=ok, other=0.0, cache_modifier=".cg")
        a_s = tl.load(acc_ptr + rows[:, :, None] * D_PAD + offs_d[None, None, :],
                      mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_all, tl.max(m_s, axis=1))
        w_old = tl.exp2(m_all - m_new)
        w_s = tl.exp2(m_s - m_new[:, None])
        l_all = l_all * w_old + tl.sum(l_s * w_s, axis=1)
        o_all = o_all * w_old[:, None] + tl.sum(a_s * w_s[:, :, None], axis=1)
        m_all = m_new
    out = o_all / tl.where(l_all > 0.0, l_all, 1.0)[:, None]
    heads = head0 + offs_g
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & (offs_d < D)[None, :])


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    qk_scale, G,
    NUM_SPLITS: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr,
    EARLY_V: tl.constexpr, FUSED_REDUCE: tl.constexpr, USE_PDL: tl.constexpr,
    G_COMB: tl.constexpr, COMBINE: tl.constexpr,
    pos_ptr, cs_ptr, stride_cs, qw_ptr, kw_ptr, slot_ptr, Hq, eps,
    FUSE_QK: tl.constexpr, HAS_NORM: tl.constexpr, ROT: tl.constexpr,
    EARLY_DEPS: tl.constexpr = False,
):
    if EARLY_DEPS:  # the next kernel (the TMA GEMV, streaming its weights meanwhile) launches now
        pdl_launch_dependents(USE_PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if not FUSE_QK:
        pdl_wait(USE_PDL)  # q and this step's k/v come from the kernel before
    seq_len = tl.load(seq_lens_ptr + b)
    # Each split takes a run of BLOCK_N tiles of this sequence's context, as few as spread
    # the context over the splits (one tile each for a short context); idle splits exit at
    # once. The combine reads COMBINE splits per round, so it costs only a few L2 round
    # trips. (plain arithmetic: tl.cdiv is itself a jit function)
    n_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
    per = tl.maximum((n_tiles + NUM_SPLITS - 1) // NUM_SPLITS, 1)
    n_active = tl.maximum((n_tiles + per - 1) // per, 1)  # split 0 also for an empty row
    chunk = per * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    # with the fused combine idle splits do nothing; the two-launch reduce reads every split,
    # so there idle ones store an empty partial
    if (split < n_active) | (not FUSED_REDUCE):
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D_PAD)
        dmask = offs_d < D
        heads = kvh * G + offs_g
        gmask = offs_g < G
        qmask = gmask[:, None] & dmask[None, :]
        bt = bt_ptr + b.to(tl.int64) * stride_bt
        if FUSE_QK:
            # q_ptr is the qkv projection output [B, (Hq + 2 Hkv) * D]: this program norms and
            # rotates its G query heads itself, and the split holding the new position writes
            # that token's k (normed, rotated) and v into the cache.
            # The split's first K/V tile, less the new position, is already in the cache (block
            # table, lengths and older keys were written before the kernel before): it loads
            # before waiting on that kernel (PDL); the new key and value are put into it below.
            offs_n0 = start + tl.arange(0, BLOCK_N)
            old0 = offs_n0 < tl.minimum(end, seq_len - 1)
            m0 = old0[:, None] & dmask[None, :]
            k0 = tl.load(k_ptr + kvh * stride_kh + _kv_tile_offsets(bt, offs_n0, old0, stride_kb, stride_kt, offs_d,
                                                                     BLOCK_SIZE), mask=m0, other=0.0)
            v0 = tl.load(v_ptr + kvh * stride_vh + _kv_tile_offsets(bt, offs_n0, old0, stride_vb, stride_vt, offs_d,
                                                                     BLOCK_SIZE), mask=m0, other=0.0)
            # positions, cos/sin, the norm weights and the slot do not come from the kernel
            # before either (host copies before the step, or kernels two or more launches back,
            # complete once the kernel before passed its own wait): load them before the wait too
            cs = cs_ptr + tl.load(pos_ptr + b) * stride_cs
            qw, qwp, cos, sin = _norm_rope_params(qw_ptr, cs, G, HAS_NORM, False, G_PAD, D, D_PAD, ROT)
            kw, kwp, _, _ = _norm_rope_params(kw_ptr, cs, 1, HAS_NORM, False, 2, D, D_PAD, ROT)
            slot = tl.load(slot_ptr + b).to(tl.int64)
            pdl_wait(USE_PDL)  # the qkv row comes from the kernel before
            row = q_ptr + b.to(tl.int64) * stride_qb
            q = _norm_rope_apply(row + kvh * G * D, qw, qwp, cos, sin, G, eps, HAS_NORM, False, G_PAD, D, D_PAD, ROT)
            q = q.to(q_ptr.dtype.element_ty)
            if split == n_active - 1:
                if slot >= 0:
                    blk = slot // BLOCK_SIZE
                    tok = slot % BLOCK_SIZE
                    k_new = _norm_rope_apply(row + (Hq + kvh) * D, kw, kwp, cos, sin, 1, eps, HAS_NORM, False, 2, D,
                                             D_PAD, ROT)
                    one = tl.arange(0, 2)[:, None] < 1
                    k_dst = k_ptr + blk * stride_kb + tok * stride_kt + kvh * stride_kh
                    tl.store(k_dst + tl.arange(0, 2)[:, None] * 0 + offs_d[None, :],
                             store_cast(k_new.to(q_ptr.dtype.element_ty), k_ptr), mask=one & dmask[None, :])
                    v_new = tl.load(row + (Hq + tl.num_programs(1) + kvh) * D + offs_d, mask=dmask, other=0.0)
                    tl.store(v_ptr + blk * stride_vb + tok * stride_vt + kvh * stride_vh + offs_d,
                             store_cast(v_new, v_ptr), mask=dmask)
                    is_new = (offs_n0 == seq_len - 1)[:, None]   # into the prefetched tile, if there
                    k_row = store_cast(tl.sum(tl.where(one, k_new, 0.0), axis=0).to(q_ptr.dtype.element_ty), k_ptr)
                    k0 = tl.where(is_new, k_row[None, :], k0)
                    v0 = tl.where(is_new, store_cast(v_new, v_ptr)[None, :], v0)
                tl.debug_barrier()  # the CTA's own k/v stores are visible to its later tiles' loads
        else:
            q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=qmask, other=0.0)
        acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
        m_i = tl.full([G_PAD], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        q_pos = tl.zeros([G_PAD], dtype=tl.int32)  # unused: decode needs only the bound
        first = start
        if FUSE_QK:  # the prefetched tile (all masked in an idle split: no change)
            p, alpha, m_i, l_i = _attn_scores(m_i, l_i, q, k0, (offs_n0 < end)[None, :], qk_scale, IEEE)
            acc = _attn_pv(acc, alpha, p, v0.to(q.dtype), IEEE)
            first = start + BLOCK_N
        for start_n in range(first, end, BLOCK_N):
            acc, m_i, l_i = _attn_tile(
                acc, m_i, l_i, q, k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh, bt,
                start_n, end, q_pos, qk_scale, stride_kb, stride_kt, stride_vb, stride_vt,
                offs_d, dmask,
                BLOCK_N, BLOCK_SIZE, False, IEEE, EARLY_V)
        pdl_launch_dependents(USE_PDL)
        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=qmask)
        else:
            # partials laid out [B, Hq, NUM_SPLITS] (+ [D_PAD] for acc)
            row = (b * (tl.num_programs(1) * G) + heads).to(tl.int64) * NUM_SPLITS + split
            keep = gmask & ((split < n_active) | (not FUSED_REDUCE))  # the fused combine skips idle splits
            tl.store(m_ptr + row, m_i, mask=keep)
            tl.store(l_ptr + row, l_i, mask=keep)
            tl.store(acc_ptr + row[:, None] * D_PAD + offs_d[None, :], acc, mask=keep[:, None])
            if FUSED_REDUCE:
                # The split that finishes last for this (sequence, kv head) combines all of
                # them: one launch instead of two. acq_rel orders the partial stores above.
                slot = cnt_ptr + b * tl.num_programs(1) + kvh
                done = tl.atomic_add(slot, 1, sem="acq_rel")
                if done == n_active - 1:
                    _combine_splits(m_ptr, l_ptr, acc_ptr, out_ptr, b, kvh * G, G, n_active,
                                    (b * (tl.num_programs(1) * G) + kvh * G).to(tl.int64) * NUM_SPLITS,
                                    stride_ob, stride_oh, NUM_SPLITS, G_COMB, COMBINE, D, D_PAD)
                    tl.atomic_xchg(slot, 0)  # ready for the next launch (CUDA graph replays too)


@triton.jit
def _decode_reduce_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, stride_ob, stride_oh, Hq,
    NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = (b * Hq + h).to(tl.int64) * NUM_SPLITS
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    smask = offs_s < NUM_SPLITS
    m = tl.load(m_ptr + row + offs_s, mask=smask, other=-1.0e30)
    l = tl.load(l_ptr + row + offs_s, mask=smask, other=0.0)
    acc = tl.load(acc_ptr + (row + offs_s)[:, None] * D_PAD + offs_d[None, :],
                  mask=smask[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))
    total = tl.sum(w * l, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < D)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    qk_scale, G,
    G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr,
):
    qb = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len
    # rows = BLOCK_Q queries x G_PAD heads (query-major)
    offs_r = tl.arange(0, BLOCK_Q * G_PAD)
    qi = qb * BLOCK_Q + offs_r // G_PAD
    g = offs_r % G_PAD
    rmask = (qi < q_len) & (g < G)
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < D
    mask = rmask[:, None] & dmask[None, :]
    tok = (q_start + qi).to(tl.int64)
    head = kvh * G + g
    q = tl.load(q_ptr + (tok * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
                mask=mask, other=0.0)
    # padded rows get the block's last position so they never see an empty row
    q_pos = prefix + tl.minimum(qi, q_len - 1)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * G_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], dtype=tl.float32)
    bt = bt_ptr + b.to(tl.int64) * stride_bt
    kp = k_ptr + kvh * stride_kh
    vp = v_ptr + kvh * stride_vh
    first_pos = prefix + qb * BLOCK_Q
    last_pos = tl.minimum(first_pos + BLOCK_Q, seq_len)  # exclusive key bound
    # keys before the block's first query are visible to every row: no mask
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attn_tile(
            acc, m_i, l_i, q, kp, vp, bt, start_n, last_pos, q_pos, qk_scale,
            stride_kb, stride_kt, stride_vb, stride_vt, offs_d, dmask,
            BLOCK_N, BLOCK_SIZE, False, IEEE, False)
    for start_n in range(full_end, last_pos, BLOCK_N):
        acc, m_i, l_i = _attn_tile(
            acc, m_i, l_i, q, kp, vp, bt, start_n, last_pos, q_pos, qk_scale,
            stride_kb, stride_kt, stride_vb, stride_vt, offs_d, dmask,
            BLOCK_N, BLOCK_SIZE, True, IEEE, False)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (tok * stride_ot + head * stride_oh)[:, None] + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)
