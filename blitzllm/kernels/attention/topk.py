"""Top-k selection over rows of indexer logits (DeepSeek-V3.2's sparse attention): per row, the
``k`` highest of its first ``lens[t]`` entries, as int32 positions in ascending order with -1
padding. Ties go to the lower position, so a selection never depends on the row's width or the
method. The Triton kernel picks its method per row by length, inside one fixed launch.
"""
from __future__ import annotations

import torch

from .._common import next_pow2, tl, triton, use_triton


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
    """See ``reference_topk``; the Triton kernel on CUDA (one launch, no host sync)."""
    if use_triton(logits):
        return topk_triton(logits, lens, k)
    return reference_topk(logits, lens, k)


# ---- Triton -------------------------------------------------------------------------------------
# Per row one program, one launch; the method by the row's length (read on the device):
#   len <= k:          every position, then -1;
#   k < len <= BLOCK:  the row stays in registers; the k-th largest key found bit by bit
#                      (32 counts over the tile), no sort;
#   len > BLOCK:       radix select over tiles: four passes of a 256-bin histogram of the next
#                      8 bits among the keys that match the bits chosen so far, then a pass
#                      that writes the selection in position order.
# Keys: fp32 bits mapped to uint32 in the same order (+0 and -0 one key, so they tie as equal
# floats do). The selection is every key above the k-th largest, then the equal ones in
# position order until k: the reference's tie rule.

@triton.jit
def _order_key(x):
    u = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def _radix_pass(row, n, prefix, remaining, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """One 8-bit digit (bits SHIFT..SHIFT+7) of the k-th largest key: (prefix with it set,
    how many keys equal to the final key remain to be taken)."""
    HIGH: tl.constexpr = (0xFFFFFFFF << (SHIFT + 8)) & 0xFFFFFFFF  # the bits decided already
    hist = tl.zeros([256], dtype=tl.int32)
    for s0 in range(0, n, BLOCK):
        offs = s0 + tl.arange(0, BLOCK)
        valid = offs < n
        key = _order_key(tl.load(row + offs, mask=valid, other=0.0))
        match = valid & ((key & HIGH) == prefix)
        hist += tl.histogram(((key >> SHIFT) & 0xFF).to(tl.int32), 256, mask=match)
    at_or_above = tl.cumsum(hist, 0, reverse=True)  # [b]: keys of the group with digit >= b
    bins = tl.arange(0, 256)
    b = tl.max(tl.where(at_or_above >= remaining, bins, -1), 0)
    above = tl.sum(tl.where(bins == b, at_or_above - hist, 0), 0)
    return prefix | (b.to(tl.uint32) << SHIFT), remaining - above


@triton.jit
def _topk_kernel(x_ptr, lens_ptr, out_ptr, stride_x, stride_o,
                 K: tl.constexpr, K_TILE: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.load(lens_ptr + t)
    row = x_ptr + t * stride_x
    out = out_ptr + t * stride_o
    if n <= K:
        for j0 in range(0, K, K_TILE):
            j = j0 + tl.arange(0, K_TILE)
            tl.store(out + j, tl.where(j < n, j, -1), mask=j < K)
    elif n <= BLOCK:
        offs = tl.arange(0, BLOCK)
        valid = offs < n
        key = _order_key(tl.load(row + offs, mask=valid, other=0.0))
        thr = tl.full([], 0, tl.uint32)
        for i in tl.static_range(32):
            cand = thr | (tl.full([], 1, tl.uint32) << (31 - i))
            count = tl.sum((valid & (key >= cand)).to(tl.int32), 0)
            thr = tl.where(count >= K, cand, thr)
        gt = valid & (key > thr)
        eq = valid & (key == thr)
        need = K - tl.sum(gt.to(tl.int32), 0)
        take = gt | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= need))
        tl.store(out + tl.cumsum(take.to(tl.int32), 0) - 1, offs, mask=take)
    else:
        prefix = tl.full([], 0, tl.uint32)
        remaining = tl.full([], K, tl.int32)
        prefix, remaining = _radix_pass(row, n, prefix, remaining, 24, BLOCK)
        prefix, remaining = _radix_pass(row, n, prefix, remaining, 16, BLOCK)
        prefix, remaining = _radix_pass(row, n, prefix, remaining, 8, BLOCK)
        prefix, remaining = _radix_pass(row, n, prefix, remaining, 0, BLOCK)
        written = tl.full([], 0, tl.int32)
        ties = tl.full([], 0, tl.int32)
        for s0 in range(0, n, BLOCK):
            offs = s0 + tl.arange(0, BLOCK)
            valid = offs < n
            key = _order_key(tl.load(row + offs, mask=valid, other=0.0))
            eq = (valid & (key == prefix)).to(tl.int32)
            take = (valid & (key > prefix)) | ((eq != 0) & (ties + tl.cumsum(eq, 0) <= remaining))
            tl.store(out + written + tl.cumsum(take.to(tl.int32), 0) - 1, offs, mask=take)
            written += tl.sum(take.to(tl.int32), 0)
            ties += tl.sum(eq, 0)


def topk_config(k: int, block: int = 0) -> dict:
    """Tile of the one-tile path and of the radix passes: rows up to 2k (at least 1024) stay in
    registers; ``block`` overrides (tests reach every path with small rows)."""
    block = block or min(8192, max(1024, next_pow2(2 * k)))
    return dict(BLOCK=block, K_TILE=min(next_pow2(k), 1024), num_warps=8 if block >= 4096 else 4)


def topk_triton(logits: torch.Tensor, lens: torch.Tensor, k: int, block: int = 0) -> torch.Tensor:
    """Same contract as reference_topk; one launch of one program per row, CUDA-graph safe."""
    T = logits.shape[0]
    out = torch.empty((T, k), dtype=torch.int32, device=logits.device)
    if T == 0:
        return out
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1
    cfg = topk_config(k, block)
    _topk_kernel[(T,)](logits, lens, out, logits.stride(0), out.stride(0), K=k, K_TILE=cfg["K_TILE"],
                       BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"])
    return out
