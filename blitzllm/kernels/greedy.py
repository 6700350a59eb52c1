"""Greedy sampling in one launch: per row of raw logits [B, V] the argmax (ties to the lowest
index, as torch.argmax) and its log-probability, by a split-row kernel whose last program to
arrive merges; cached workspace, no host sync, CUDA-graph safe.
"""
from __future__ import annotations

import functools

import torch

from . import cpu_decode
from ._common import device_sms, next_pow2, tl, triton, use_triton

_BLOCK = 1024


# splits is a plain argument (not specialised) and the merge reads _MAX_SPLITS slots: one
# compiled kernel for every row count, as the verify steps of speculative decoding need
# (their row count changes step to step; a constexpr split count compiled anew for each).
_MAX_SPLITS = 256


@triton.jit(do_not_specialize=["splits"])
def _greedy_kernel(x_ptr, stride_x, V, chunk, tok_ptr, lp_ptr, m_ws, s_ws, i_ws, cnt_ptr, splits,
                   S_PAD: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    sp = tl.program_id(1)
    row = x_ptr + b.to(tl.int64) * stride_x
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, V)
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)   # per lane: max, its first index, sum exp
    idx = tl.full([BLOCK], 2147483647, tl.int32)
    s = tl.zeros([BLOCK], tl.float32)
    for k in range(lo, hi, BLOCK):
        i = k + offs
        x = tl.load(row + i, mask=i < hi, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # lanes see increasing indices: a strictly larger value takes the index
        idx = tl.where(x > m, i, idx)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        s = tl.where(m_new == float("-inf"), 0.0, s)
        m = m_new
    mx = tl.max(m, axis=0)
    first = tl.min(tl.where(m == mx, idx, 2147483647), axis=0)
    tot = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - mx)), axis=0)
    slot = b * splits + sp
    tl.store(m_ws + slot, mx)
    tl.store(s_ws + slot, tot)
    tl.store(i_ws + slot, first)
    done = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel")
    if done == splits - 1:   # the last slice of this row: merge
        offs_s = tl.arange(0, S_PAD)
        ok = offs_s < splits
        ms = tl.load(m_ws + b * splits + offs_s, mask=ok, other=float("-inf"), cache_modifier=".cg")
        ss = tl.load(s_ws + b * splits + offs_s, mask=ok, other=0.0, cache_modifier=".cg")
        ids = tl.load(i_ws + b * splits + offs_s, mask=ok, other=2147483647, cache_modifier=".cg")
        gmax = tl.max(ms, axis=0)
        tok = tl.min(tl.where(ms == gmax, ids, 2147483647), axis=0)
        total = tl.sum(tl.where(ms == float("-inf"), 0.0, ss * tl.exp(ms - gmax)), axis=0)
        tl.store(tok_ptr + b, tok.to(tl.int64))
        tl.store(lp_ptr + b, -tl.log(total))   # max - (max + log(sum exp(x - max)))
        tl.atomic_xchg(cnt_ptr + b, 0)


@functools.lru_cache(maxsize=None)
def _workspace(device: torch.device, n: int) -> tuple:
    f = dict(device=device)
    return (torch.empty(n, dtype=torch.float32, **f), torch.empty(n, dtype=torch.float32, **f),
            torch.empty(n, dtype=torch.int32, **f), torch.zeros(n, dtype=torch.int32, **f))


def greedy_sample_triton(logits: torch.Tensor, splits: int | None = None) -> tuple:
    """logits [B, V] (fp32 / bf16 / fp16) -> (tokens [B] int64, logprobs [B] float32)."""
    assert logits.dim() == 2 and logits.stride(1) == 1
    B, V = logits.shape
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    lps = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B == 0:
        return tokens, lps
    if splits is None:  # about two programs per SM, each slice at least one block
        splits = max(1, min(triton.cdiv(2 * device_sms(logits), B), triton.cdiv(V, _BLOCK), _MAX_SPLITS))
    chunk = triton.cdiv(triton.cdiv(V, splits), _BLOCK) * _BLOCK
    splits = triton.cdiv(V, chunk)
    assert splits <= _MAX_SPLITS, f"at most {_MAX_SPLITS} slices per row"
    m_ws, s_ws, i_ws, cnt = _workspace(logits.device, next_pow2(max(B * splits, B, 1024)))
    assert B * splits <= m_ws.numel()
    _greedy_kernel[(B, splits)](logits, logits.stride(0), V, chunk, tokens, lps, m_ws, s_ws, i_ws, cnt, splits,
                                S_PAD=_MAX_SPLITS, BLOCK=_BLOCK, num_warps=4)
    return tokens, lps


def reference_greedy_sample(logits: torch.Tensor) -> tuple:
    x = logits.float()
    tok = x.argmax(dim=-1)
    return tok, x.gather(1, tok[:, None]).squeeze(1) - x.logsumexp(dim=-1)


def greedy_sample(logits: torch.Tensor, kernel: bool = True) -> tuple:
    """(argmax token, its log-softmax) per row: Triton on CUDA (rows up to 4096 slices'
    workspace), one C call on an AVX-512 CPU (kernels/cpu_decode; ``kernel=False``: the torch
    ops, knob ``BLITZ_GREEDY_KERNEL``), torch elsewhere."""
    if kernel and use_triton(logits) and logits.dim() == 2 and logits.stride(1) == 1 and 0 < logits.shape[0] <= 1024:
        return greedy_sample_triton(logits)
    if kernel and logits.device.type == "cpu" and logits.dim() == 2 and logits.numel() and cpu_decode.available():
        out = cpu_decode.greedy(logits)  # (None where a row holds a NaN)
        if out is not None:
            return out
    return reference_greedy_sample(logits)
