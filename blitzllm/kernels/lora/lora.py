"""The LoRA rows of a wrapped linear, ``y[row] += (x[row] @ A[s]^T) @ B[s]`` for the row's slot
``s`` (-1: the base model, nothing added), over a slot table A [slots, SR, K] and B transposed
[slots, SR, N] (SR: the module's slices times the rank; blitzllm/lora/manager.py lays them out).

Two forms:
- ``lora_add_triton``: a shrink kernel (each row reads only its own slot's A, split over K so a
  few rows still fill the GPU) and an expand kernel that sums the shrink's partials and adds the
  row's B product into ``y`` in place. Two launches a linear whatever the batch's adapters, and
  no shape depends on them, so the decode CUDA graphs capture it. Each row reads its slot's A
  once: meant for decode batches (``KERNEL_MAX_ROWS``), where launches, not FLOPs, are the cost.
  On Hopper both launch early (PDL): a tile of A / B loads before the wait on the kernel before.
- ``reference_lora_add``: torch, every row through every slot's A at once (one GEMM) and a one-hot
  mask of the row's slot (``slot_mask``) before one ``addmm`` of B: more FLOPs, but tensor-core
  GEMMs for a prefill's thousands of rows, and on the CPU.
"""
from __future__ import annotations

import torch

from .._common import (device_sms, next_pow2, pdl_enabled, pdl_launch_dependents, pdl_launch_kwargs, pdl_wait, tl,
                       triton, unit_stride, use_triton)
from ..activation import silu_and_mul

KERNEL_MAX_ROWS = 2   # more rows take the one-GEMM form: here each row re-reads its slot's A and B, and
                      # on an H100 4 rows already ran slower than the GEMMs (docs/lora.md)
_BLOCK_K = 128
_BLOCK_N = 128
_MAX_SPLITS = 32


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, part_ptr, K, SR, stride_x, stride_as, stride_ar,
                   stride_ps, stride_pr, K_PER_SPLIT, SILU_MUL: tl.constexpr, SR_PAD: tl.constexpr,
                   BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """part[split, row, :SR] = x[row, this split's K] @ A[slot]^T (fp32), for rows with a slot."""
    pdl_launch_dependents(USE_PDL)   # (the expand after it only prefetches B before its wait)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    slot = tl.load(slot_ptr + row)   # (a step input, written before the kernels of the step)
    if slot >= 0:
        r = tl.arange(0, SR_PAD)
        acc = tl.zeros([SR_PAD], dtype=tl.float32)
        a_rows = a_ptr + slot.to(tl.int64) * stride_as + r[:, None] * stride_ar
        k0 = split * K_PER_SPLIT
        k1 = tl.minimum(k0 + K_PER_SPLIT, K)
        cols = k0 + tl.arange(0, BLOCK_K)
        # A does not depend on the kernel before: its first tile loads before the PDL wait
        a = tl.load(a_rows + cols[None, :], mask=(r[:, None] < SR) & (cols < k1)[None, :], other=0.0)
        pdl_wait(USE_PDL)
        for k in range(k0, k1, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            cm = cols < k1
            xv = tl.load(x_ptr + row * stride_x + cols, mask=cm, other=0.0)
            if SILU_MUL:  # x is gate | up: the numerics of activation.silu_and_mul
                up = tl.load(x_ptr + row * stride_x + K + cols, mask=cm, other=0.0)
                g = xv.to(tl.float32)
                act = (g / (1.0 + tl.exp(-g))).to(up.dtype)
                xv = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
            if k > k0:
                a = tl.load(a_rows + cols[None, :], mask=(r[:, None] < SR) & cm[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
        tl.store(part_ptr + split * stride_ps + row * stride_pr + r, acc, mask=r < SR)
    else:
        pdl_wait(USE_PDL)   # (every program waits: the kernel ends after the one before)


@triton.jit
def _expand_kernel(y_ptr, part_ptr, b_ptr, slot_ptr, N, SR, SPLITS, stride_y, stride_ps, stride_pr,
                   stride_bs, stride_br, SR_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                   USE_PDL: tl.constexpr):
    """y[row, this block] += (sum of the row's shrink partials) @ B[slot][:, this block]."""
    pdl_launch_dependents(USE_PDL)   # (PDL kernels wait for all of this one before they read)
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row)
    if slot >= 0:
        r = tl.arange(0, SR_PAD)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cm = cols < N
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + r[:, None] * stride_br + cols[None, :],
                    mask=(r[:, None] < SR) & cm[None, :], other=0.0)
        pdl_wait(USE_PDL)
        sp = tl.arange(0, SPLITS_PAD)   # (every partial in one load, not a chain of them)
        t = tl.sum(tl.load(part_ptr + sp[:, None] * stride_ps + row * stride_pr + r[None, :],
                           mask=(sp[:, None] < SPLITS) & (r[None, :] < SR), other=0.0), axis=0)
        delta = tl.sum(b.to(tl.float32) * t[:, None], axis=0)
        y_ptrs = y_ptr + row * stride_y + cols
        y = tl.load(y_ptrs, mask=cm, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=cm)
    else:
        pdl_wait(USE_PDL)   # (every program waits: the kernel ends after the one before)


def _splits(rows: int, k: int, sms: int) -> int:
    """K splits of the shrink: about one program per SM, each at least one K block, at most
    ``_MAX_SPLITS`` (the expand sums them all)."""
    return max(1, min(triton.cdiv(k, _BLOCK_K), sms // max(rows, 1), _MAX_SPLITS))


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                    silu_mul_input: bool = False, splits: int = 0) -> torch.Tensor:
    """``y`` [M, N] += the LoRA rows of x [M, K] (gate | up [M, 2K] with ``silu_mul_input``) for
    ``slots`` [M] (int, -1: none), in place; returns y. ``splits``: the shrink's K splits (0:
    the heuristic)."""
    rows, n = y.shape
    k, sr = a.shape[-1], a.shape[1]
    assert x.shape[0] == rows and x.shape[1] == (2 * k if silu_mul_input else k) and b.shape[-1] == n
    assert y.stride(-1) == 1 and a.is_contiguous() and b.is_contiguous()
    x = unit_stride(x)
    if rows == 0:
        return y
    splits = splits or _splits(rows, k, device_sms(x))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), _BLOCK_K) * _BLOCK_K
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty(splits, rows, sr, dtype=torch.float32, device=x.device)
    sr_pad = max(16, next_pow2(sr))
    pdl = pdl_enabled(x)
    _shrink_kernel[(rows, splits)](x, a, slots, part, k, sr, x.stride(0), a.stride(0), a.stride(1),
                                   part.stride(0), part.stride(1), k_per_split, SILU_MUL=silu_mul_input,
                                   SR_PAD=sr_pad, BLOCK_K=_BLOCK_K, USE_PDL=pdl, num_warps=4,
                                   **pdl_launch_kwargs(pdl))
    block_n = min(_BLOCK_N, max(16, next_pow2(n)))
    _expand_kernel[(rows, triton.cdiv(n, block_n))](y, part, b, slots, n, sr, splits, y.stride(0), part.stride(0),
                                                    part.stride(1), b.stride(0), b.stride(1), SR_PAD=sr_pad,
                                                    SPLITS_PAD=next_pow2(splits), BLOCK_N=block_n, USE_PDL=pdl,
                                                    num_warps=4,
                                                    **pdl_launch_kwargs(pdl))
    return y


def slot_mask(slots: torch.Tensor, n_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """The one-hot [M, slots, 1] of each row's slot (all zeros for -1), for ``reference_lora_add``."""
    ids = torch.arange(n_slots, device=slots.device)
    return (slots[:, None, None] == ids[None, :, None]).to(dtype)


def reference_lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor,
                       silu_mul_input: bool = False) -> torch.Tensor:
    """``lora_add_triton`` in torch, with the rows' ``slot_mask``: one GEMM through every slot's
    A, the mask, one ``addmm`` of B into ``y`` (in place)."""
    if silu_mul_input:
        x = silu_and_mul(x)
    n = a.shape[0]
    xa = (x @ a.view(-1, a.shape[-1]).t()).view(x.shape[0], n, -1) * mask
    return y.addmm_(xa.view(x.shape[0], -1), b.view(-1, b.shape[-1]))


def use_lora_kernels(slots: torch.Tensor) -> bool:
    """Whether a step whose rows have adapter ``slots`` [rows] takes ``lora_add_triton`` (else
    ``reference_lora_add``)."""
    assert slots.dim() == 1, "slots: one per row"
    return use_triton(slots) and slots.numel() <= KERNEL_MAX_ROWS
