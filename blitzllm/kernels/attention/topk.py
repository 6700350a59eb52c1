"""Top-k selection over rows of indexer logits (DeepSeek-V3.2's sparse attention): per row, the
``k`` highest of its first ``lens[t]`` entries, as int32 positions in ascending order with -1
padding. Ties go to the lower position, so a selection never depends on the row's width or the
method. The Triton kernels pick their method per row by length, in a fixed sequence of launches.
"""
from __future__ import annotations

import torch

from .._common import next_pow2, num_sms, tl, triton, use_triton


def reference_topk(logits: torch.Tensor, lens: torch.Tensor, k: int) -> torch.Tensor:
    """logits [T, N] fp32 (finite where valid), lens [T] int32 (<= N) -> [T, k] int32: the
    positions of the min(k, lens[t]) largest logits[t, :lens[t]] (equal values: the lower
    position first), ascending, then -1."""
    T, N = logits.shape
    cols = torch.arange(N, device=logits.device)
    valid = cols[None, :] < lens[:, None].long()
    x = logits.float().masked_fill(~valid, float("-inf"))
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]   # ties: lower first
    if order.shape[1] < k:
        order = torch.cat([order, order.new_full((T, k - order.shape[1]), N)], 1)
    rank = torch.arange(k, device=logits.device)
    chosen = torch.where(rank[None, :] < lens[:, None].long(), order, N)          # N: a padding slot
    chosen = torch.sort(chosen, dim=-1).values
    return torch.where(chosen < N, chosen, -1).to(torch.int32)


def topk(logits: torch.Tensor, lens: torch.Tensor, k: int) -> torch.Tensor:
    """See ``reference_topk``; the Triton kernels on CUDA (a fixed launch sequence, no host sync)."""
    fn = topk_triton if use_triton(logits) else reference_topk
    return fn(logits, lens, k)


# ---- Triton -------------------------------------------------------------------------------------
# Keys: fp32 bits mapped to uint32 in the same order (+0 and -0 one key, so they tie as equal
# floats do). The k-th largest key is found one 8-bit digit at a time (a 256-bin histogram of
# the keys that match the digits chosen so far); the selection is every key above it, then the
# equal ones in position order until k: the reference's tie rule.
#   len <= k:          every position, then -1 (one program);
#   k < len <= BLOCK:  the row stays in one program's registers (its k-th key bit by bit);
#   len > BLOCK:       CHUNK-wide programs per row, so a long row spreads over the SMs (one
#                      program over a 128K row took 8x torch.topk's time): four launches add
#                      their chunks' histograms of one digit each into [T, 4, 256] counts, one
#                      counts each chunk's picks, one writes them at the offsets the earlier
#                      chunks' counts give.
# A launch's grid covers the logits' width; programs past their row's length return at once.

@triton.jit
def _order_key(x):
    u = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def _pick(hist, prefix, remaining, SHIFT: tl.constexpr):
    """Given the histogram of digit SHIFT..SHIFT+7 among the keys matching ``prefix``: (prefix
    with the k-th largest key's digit set, how many keys equal to the final key remain to take)."""
    at_or_above = tl.cumsum(hist, 0, reverse=True)  # [b]: keys of the group with digit >= b
    bins = tl.arange(0, 256)
    b = tl.max(tl.where(at_or_above >= remaining, bins, -1), 0)
    above = tl.sum(tl.where(bins == b, at_or_above - hist, 0), 0)
    return prefix | (b.to(tl.uint32) << SHIFT), remaining - above


@triton.jit
def _digit_hist(key, valid, prefix, SHIFT: tl.constexpr):
    HIGH: tl.constexpr = (0xFFFFFFFF << (SHIFT + 8)) & 0xFFFFFFFF  # the bits decided already
    match = valid & ((key & HIGH) == prefix)
    return tl.histogram(((key >> SHIFT) & 0xFF).to(tl.int32), 256, mask=match)


@triton.jit
def _decided(hist_row, K, DIGITS: tl.constexpr):
    """(prefix, remaining) after the first DIGITS digits, from the row's summed histograms."""
    prefix = tl.full([], 0, tl.uint32)
    remaining = tl.full([], K, tl.int32)
    for d in tl.static_range(DIGITS):
        prefix, remaining = _pick(tl.load(hist_row + d * 256 + tl.arange(0, 256)), prefix, remaining, 24 - 8 * d)
    return prefix, remaining


@triton.jit
def _chunk_keys(x_ptr, lens_ptr, stride_x, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """This program's chunk of a long row: (go, keys, valid, offsets, row length); go is false for a
    row that fits one program or a chunk past the row's end."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.load(lens_ptr + t)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    go = (n > BLOCK) & (tl.program_id(1) * CHUNK < n)
    valid = go & (offs < n)
    key = _order_key(tl.load(x_ptr + t * stride_x + offs, mask=valid, other=0.0))
    return go, key, valid, offs, n


@triton.jit
def _chunk_hist_kernel(x_ptr, lens_ptr, hist_ptr, stride_x, K,
                       DIGIT: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    go, key, valid, offs, n = _chunk_keys(x_ptr, lens_ptr, stride_x, BLOCK, CHUNK)
    if go:
        hist_row = hist_ptr + tl.program_id(0).to(tl.int64) * 1024
        prefix, remaining = _decided(hist_row, K, DIGIT)
        hist = _digit_hist(key, valid, prefix, 24 - 8 * DIGIT)
        bins = tl.arange(0, 256)
        tl.atomic_add(hist_row + DIGIT * 256 + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _chunk_count_kernel(x_ptr, lens_ptr, hist_ptr, counts_ptr, stride_x, K,
                        BLOCK: tl.constexpr, CHUNK: tl.constexpr, P_PAD: tl.constexpr):
    go, key, valid, offs, n = _chunk_keys(x_ptr, lens_ptr, stride_x, BLOCK, CHUNK)
    if go:
        t = tl.program_id(0).to(tl.int64)
        prefix, remaining = _decided(hist_ptr + t * 1024, K, 4)
        at = counts_ptr + (t * P_PAD + tl.program_id(1)) * 2
        tl.store(at, tl.sum((valid & (key > prefix)).to(tl.int32), 0))
        tl.store(at + 1, tl.sum((valid & (key == prefix)).to(tl.int32), 0))


@triton.jit
def _topk_write_kernel(x_ptr, lens_ptr, hist_ptr, counts_ptr, out_ptr, stride_x, stride_o,
                       K: tl.constexpr, K_TILE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                       P_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    n = tl.load(lens_ptr + t)
    out = out_ptr + t * stride_o
    if n <= BLOCK:
        if p == 0:
            if n <= K:
                for j0 in range(0, K, K_TILE):
                    j = j0 + tl.arange(0, K_TILE)
                    tl.store(out + j, tl.where(j < n, j, -1), mask=j < K)
            else:
                offs = tl.arange(0, BLOCK)
                valid = offs < n
                key = _order_key(tl.load(x_ptr + t * stride_x + offs, mask=valid, other=0.0))
                # the k-th largest key bit by bit (32 counts over the tile): faster here than
                # four histogram digits (tl.histogram costs more than a reduction)
                prefix = tl.full([], 0, tl.uint32)
                for i in tl.static_range(32):
                    cand = prefix | (tl.full([], 1, tl.uint32) << (31 - i))
                    count = tl.sum((valid & (key >= cand)).to(tl.int32), 0)
                    prefix = tl.where(count >= K, cand, prefix)
                remaining = K - tl.sum((valid & (key > prefix)).to(tl.int32), 0)
                eq = valid & (key == prefix)
                take = (valid & (key > prefix)) | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= remaining))
                tl.store(out + tl.cumsum(take.to(tl.int32), 0) - 1, offs, mask=take)
    else:
        go, key, valid, offs, n = _chunk_keys(x_ptr, lens_ptr, stride_x, BLOCK, CHUNK)
        if go:
            prefix, remaining = _decided(hist_ptr + t * 1024, K, 4)
            q = tl.arange(0, P_PAD)
            before = q < p
            gt_before = tl.sum(tl.load(counts_ptr + (t * P_PAD + q) * 2, mask=before, other=0), 0)
            eq_before = tl.sum(tl.load(counts_ptr + (t * P_PAD + q) * 2 + 1, mask=before, other=0), 0)
            taken_eq_before = tl.minimum(eq_before, remaining)
            eq = (valid & (key == prefix)).to(tl.int32)
            take = (valid & (key > prefix)) | ((eq != 0) & (eq_before + tl.cumsum(eq, 0) <= remaining))
            tl.store(out + gt_before + taken_eq_before + tl.cumsum(take.to(tl.int32), 0) - 1, offs, mask=take)


def topk_config(k: int, block: int = 0, chunk: int = 0, programs: int = 0, sms: int = 0) -> dict:
    """BLOCK: rows up to 2k (at least 1024) stay in one program's registers; CHUNK: the span of
    each program over a longer row, the narrowest that keeps the grid (``programs`` at a span of
    one key) within 4 programs an SM: at one row of 32K or 128K keys 1024 took 0.58x the time
    of 4096, at 8 rows of 128K 2048 and 4096 were even and 1024 1.12x. ``block`` / ``chunk``
    override (tests reach every path with small rows)."""
    block = block or min(8192, max(1024, next_pow2(2 * k)))
    if not chunk:
        chunk = next((c for c in (1024, 2048) if sms and -(-programs // c) <= 4 * sms), 4096)
    return dict(BLOCK=block, CHUNK=chunk, K_TILE=min(next_pow2(k), 1024), num_warps=8 if block >= 4096 else 4)


def topk_triton(logits: torch.Tensor, lens: torch.Tensor, k: int, block: int = 0, chunk: int = 0) -> torch.Tensor:
    """Same contract as reference_topk; a fixed sequence of launches, no host sync: CUDA-graph safe."""
    T, N = logits.shape
    out = torch.empty((T, k), dtype=torch.int32, device=logits.device)
    if T == 0:
        return out
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1
    cfg = topk_config(k, block, chunk, T * N, num_sms(logits.device.index or 0) if logits.is_cuda else 0)
    B, C = cfg["BLOCK"], cfg["CHUNK"]
    P = triton.cdiv(N, C) if N > B else 1
    P_PAD = next_pow2(P)
    hist = torch.zeros((T, 4, 256), dtype=torch.int32, device=logits.device)
    counts = torch.empty((T, P_PAD, 2), dtype=torch.int32, device=logits.device)
    if N > B:
        for d in range(4):
            _chunk_hist_kernel[(T, P)](logits, lens, hist, logits.stride(0), k, DIGIT=d, BLOCK=B, CHUNK=C,
                                       num_warps=4)
        _chunk_count_kernel[(T, P)](logits, lens, hist, counts, logits.stride(0), k, BLOCK=B, CHUNK=C,
                                    P_PAD=P_PAD, num_warps=4)
    _topk_write_kernel[(T, P)](logits, lens, hist, counts, out, logits.stride(0), out.stride(0), K=k,
                               K_TILE=cfg["K_TILE"], BLOCK=B, CHUNK=C, P_PAD=P_PAD, num_warps=cfg["num_warps"])
    return out
