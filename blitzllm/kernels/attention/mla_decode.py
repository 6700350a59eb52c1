"""DeepSeek MLA decode over the paged latent cache [num_blocks, block_size, 1, R + P] in the
absorbed form (W_kv_b folded in by the caller): the split-K kernel, its combine launch and
their heuristic; no host sync (docs/gpu-performance.md#mla).
"""
from __future__ import annotations

from typing import Optional

import torch

from .._common import device_sms, next_pow2, tl, triton, unit_stride, use_triton
from .kv_store import is_fp8

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 128


@triton.jit
def _split_plan(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """(tiles per split, active splits) of a sequence: its BLOCK_N tiles spread evenly
    over at most num_splits splits; split 0 is active even for an empty sequence."""
    n_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
    per = tl.maximum((n_tiles + num_splits - 1) // num_splits, 1)
    n_active = tl.maximum((n_tiles + per - 1) // per, 1)
    return per, n_active


@triton.jit
def _mla_split_kernel(
    qn_ptr, qr_ptr, cache_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_ptr, lse_ptr,
    stride_qnb, stride_qnh, stride_qrb, stride_qrh, stride_cb, stride_ct, stride_bt,
    stride_ob, stride_oh, H, qk_scale,
    R: tl.constexpr, P: tl.constexpr, R_PAD: tl.constexpr, P_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    IEEE: tl.constexpr,
    idx_ptr=None, stride_idx=0, K: tl.constexpr = 1, K_PAD: tl.constexpr = 1, SPARSE: tl.constexpr = False,
):
    """SPARSE (sparse_mla.py): row b attends to the positions idx[b, :K] (selected first, then -1)
    instead of 0..seq_len-1; their count plans the splits, and program (0, 0) stores it into
    seq_lens for the combine launch."""
    hb = tl.program_id(0)  # fastest axis: the head blocks of one tile run side by side (L2 reuse)
    split = tl.program_id(1)
    b = tl.program_id(2)
    num_splits = tl.num_programs(1)
    b64 = b.to(tl.int64)
    if SPARSE:
        irow = idx_ptr + b64 * stride_idx
        offs_k = tl.arange(0, K_PAD)
        seq_len = tl.sum((tl.load(irow + offs_k, mask=offs_k < K, other=-1) >= 0).to(tl.int32), 0)
        if hb == 0 and split == 0:
            tl.store(seq_lens_ptr + b, seq_len)
    else:
        seq_len = tl.load(seq_lens_ptr + b)
    per, n_active = _split_plan(seq_len, num_splits, BLOCK_N)
    if split >= n_active:
        return
    start = split * per * BLOCK_N
    end = tl.minimum(start + per * BLOCK_N, seq_len)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    offs_r = tl.arange(0, R_PAD)
    offs_p = tl.arange(0, P_PAD)
    rmask = offs_r < R
    pmask = offs_p < P
    qn = tl.load(qn_ptr + b64 * stride_qnb + heads[:, None] * stride_qnh + offs_r[None, :],
                 mask=hmask[:, None] & rmask[None, :], other=0.0)
    qr = tl.load(qr_ptr + b64 * stride_qrb + heads[:, None] * stride_qrh + offs_p[None, :],
                 mask=hmask[:, None] & pmask[None, :], other=0.0)
    acc = tl.zeros([BLOCK_H, R_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)  # finite: no inf - inf
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    bt = bt_ptr + b64 * stride_bt
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        if SPARSE:
            pos = tl.load(irow + offs_n, mask=valid, other=-1)
            valid = pos >= 0
            pos = tl.maximum(pos, 0)
        else:
            pos = offs_n
        blk = tl.load(bt + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = cache_ptr + blk * stride_cb + (pos % BLOCK_SIZE) * stride_ct
        c = tl.load(row[:, None] + offs_r[None, :], mask=valid[:, None] & rmask[None, :], other=0.0).to(qn.dtype)
        kr = tl.load(row[:, None] + R + offs_p[None, :], mask=valid[:, None] & pmask[None, :],
                     other=0.0).to(qr.dtype)
        if IEEE:
            s = tl.dot(qn, tl.trans(c), input_precision="ieee")
            s = tl.dot(qr, tl.trans(kr), s, input_precision="ieee")
        else:
            s = tl.dot(qn, tl.trans(c))
            s = tl.dot(qr, tl.trans(kr), s)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m_i = m_new
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / safe_l[:, None]
    omask = hmask[:, None] & rmask[None, :]
    if n_active == 1:  # the whole context in this split: final output, no combine
        tl.store(out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=omask)
    else:  # partials [B, H, num_splits] (+ [R_PAD]): normalised output and base-2 lse
        prow = (b64 * H + heads) * num_splits + split
        tl.store(part_ptr + prow[:, None] * R_PAD + offs_r[None, :], out, mask=omask)
        tl.store(lse_ptr + prow, m_i + tl.log2(safe_l), mask=hmask)


@triton.jit
def _mla_combine_kernel(
    part_ptr, lse_ptr, seq_lens_ptr, out_ptr, stride_ob, stride_oh, H, num_splits,
    R: tl.constexpr, R_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    S_CHUNK: tl.constexpr,
):
    """out[b, h, r-chunk] = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max)."""
    h = tl.program_id(0)
    rb = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    _, n_active = _split_plan(seq_len, num_splits, BLOCK_N)
    if n_active == 1:  # the split kernel wrote this row itself
        return
    prow = (b.to(tl.int64) * H + h) * num_splits
    offs_s = tl.arange(0, S_CHUNK)
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    top = tl.full([S_CHUNK], -1.0e30, dtype=tl.float32)
    for s0 in range(0, n_active, S_CHUNK):
        lse = tl.load(lse_ptr + prow + s0 + offs_s, mask=s0 + offs_s < n_active, other=-1.0e30)
        top = tl.maximum(top, lse)
    top_all = tl.max(top, axis=0)
    total = tl.zeros([S_CHUNK], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for s0 in range(0, n_active, S_CHUNK):  # S_CHUNK partial rows a step: many loads in flight
        smask = s0 + offs_s < n_active
        lse = tl.load(lse_ptr + prow + s0 + offs_s, mask=smask, other=0.0)
        w = tl.where(smask, tl.exp2(lse - top_all), 0.0)
        o = tl.load(part_ptr + (prow + s0 + offs_s)[:, None] * R_PAD + offs_r[None, :],
                    mask=smask[:, None], other=0.0)
        acc += tl.sum(o * w[:, None], axis=0)
        total += w
    out = acc / tl.sum(total, axis=0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_r,
             out.to(out_ptr.dtype.element_ty), mask=offs_r < R)


def mla_config(B: int, H: int, R: int, max_ctx: int, sms: int, config: Optional[dict] = None,
               fp32: bool = False) -> dict:
    """Launch settings: heads per program, tokens per tile, warps, stages, context splits.
    Entries of `config` override the heuristic (the benchmark sweeps them)."""
    cfg = dict(config or {})
    block_h = cfg.get("BLOCK_H") or (16 if fp32 else 64 if H > 32 else max(16, next_pow2(H)))
    block_n = cfg.get("BLOCK_N") or (16 if fp32 or next_pow2(R) < 256 else 32)
    warps = cfg.get("num_warps") or (4 if block_h <= 16 else 8)
    hb = triton.cdiv(H, block_h)
    # One wave: batch x head blocks x splits <= resident programs (about 8 warps an SM),
    # never more splits than tiles in the widest context.
    splits = cfg.get("SPLITS") or max(1, sms * max(1, 8 // warps) // max(1, B * hb))
    splits = max(1, min(splits, _MAX_SPLITS, triton.cdiv(max(1, max_ctx), block_n)))
    return dict(BLOCK_H=block_h, BLOCK_N=block_n, SPLITS=splits, num_warps=warps,
                num_stages=cfg.get("num_stages") or 2)


def mla_decode_triton(q_latent, q_rope, cache, block_tables, seq_lens, scale,
                      config: Optional[dict] = None):
    """Same contract as reference_mla_decode; `config` overrides mla_config's choices."""
    B, H, R = q_latent.shape
    P = q_rope.shape[2]
    assert cache.dim() == 4 and cache.shape[2] == 1 and cache.shape[3] == R + P, cache.shape
    assert q_rope.shape[:2] == (B, H) and cache.stride(3) == 1
    out = torch.empty_like(q_latent)
    if B == 0 or H == 0:
        return out
    return _launch(q_latent, q_rope, cache, block_tables, seq_lens, scale, out,
                   block_tables.shape[1] * cache.shape[1], config)


def _launch(q_latent, q_rope, cache, block_tables, seq_lens, scale, out, max_ctx: int, config: Optional[dict],
            **sparse) -> torch.Tensor:
    """The launches of ``mla_decode_triton`` and ``sparse_mla_triton`` (``sparse``: the split
    kernel's SPARSE arguments; ``seq_lens`` then receives each row's count) into ``out``: the
    split kernel, then with several splits the combine."""
    B, H, R = q_latent.shape
    P = q_rope.shape[2]
    # the products run in the cache's precision, an fp8 cache's in the queries' (its latents widened as they load)
    dt = q_latent.dtype if is_fp8(cache.dtype) else cache.dtype
    q_latent, q_rope = unit_stride(q_latent.to(dt)), unit_stride(q_rope.to(dt))
    cfg = mla_config(B, H, R, max_ctx, device_sms(q_latent), config, fp32=dt == torch.float32)
    s, r_pad, p_pad = cfg["SPLITS"], max(16, next_pow2(R)), max(16, next_pow2(P))
    if s > 1:
        part = torch.empty((B, H, s, r_pad), dtype=torch.float32, device=out.device)
        lse = torch.empty((B, H, s), dtype=torch.float32, device=out.device)
    else:  # never touched (every sequence has one split); fp32 keeps one compiled variant
        part = lse = torch.empty(1, dtype=torch.float32, device=out.device)
    _mla_split_kernel[(triton.cdiv(H, cfg["BLOCK_H"]), s, B)](
        q_latent, q_rope, cache, block_tables, seq_lens, out, part, lse,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        cache.stride(0), cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), H, float(scale) * _LOG2E,
        R=R, P=P, R_PAD=r_pad, P_PAD=p_pad, BLOCK_H=cfg["BLOCK_H"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_SIZE=cache.shape[1], IEEE=dt == torch.float32,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **sparse,
    )
    if s > 1:
        block_r = min(r_pad, 128)
        _mla_combine_kernel[(H, r_pad // block_r, B)](
            part, lse, seq_lens, out, out.stride(0), out.stride(1), H, s,
            R=R, R_PAD=r_pad, BLOCK_R=block_r, BLOCK_N=cfg["BLOCK_N"],
            S_CHUNK=8 if s <= 8 else 32, num_warps=4,
        )
    return out


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


def mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed MLA decode (see reference_mla_decode for shapes): the Triton kernels for
    CUDA tensors (no host sync: CUDA-graph safe), the torch reference otherwise."""
    fn = mla_decode_triton if use_triton(q_latent) else reference_mla_decode
    return fn(q_latent, q_rope, cache, block_tables, seq_lens, scale)
