"""LoRA on rows that each name an adapter slot (-1: none), added into the base product in place:
``y += (x @ A[slot]^T) @ B^T[slot]`` per row, with A [slots, S*R, in] and B^T [slots, S*R, out]
as ``blitzllm/lora/manager.py`` stacks them.

For the few rows of a decode step, two Triton launches (vLLM's punica kernels work this way,
"shrink" then "expand"): each row reads only its own slot's A and B, and a row of slot -1 skips
both. For more rows (prefill, large decode batches), the torch form, which is also the reference:
every row through all the slots' A at once, a one-hot mask of its slot, and one ``addmm_``. Its
shapes never depend on which rows hold which adapter either, so both forms are CUDA-graph safe.
"""
import torch

from .._common import next_pow2, tl, triton, use_triton

MAX_KERNEL_ROWS = 16  # above: the masked GEMMs (each kernel row reads its slot's A and B alone)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, out_ptr, K, SR, stride_x, stride_as, stride_ar, stride_o,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rs < SR
    slot = tl.load(slot_ptr + row).to(tl.int64)
    acc = tl.zeros((BLOCK_R,), tl.float32)
    if slot >= 0:
        a_row = a_ptr + slot * stride_as + rs[:, None] * stride_ar
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < K
            x = tl.load(x_ptr + row * stride_x + ks, mask=kmask, other=0.0).to(tl.float32)
            a = tl.load(a_row + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], 1)
    tl.store(out_ptr + row * stride_o + rs, acc.to(out_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _expand_kernel(xa_ptr, b_ptr, slot_ptr, y_ptr, SR, N, stride_xa, stride_bs, stride_br, stride_y,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:
        ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = ns < N
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for r0 in range(0, SR, BLOCK_R):
            rs = r0 + tl.arange(0, BLOCK_R)
            rmask = rs < SR
            xa = tl.load(xa_ptr + row * stride_xa + rs, mask=rmask, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + slot * stride_bs + rs[:, None] * stride_br + ns[None, :],
                        mask=rmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(xa[:, None] * b, 0)
        y = tl.load(y_ptr + row * stride_y + ns, mask=nmask, other=0.0).to(tl.float32)
        # (one rounding of y + the product, as addmm_ rounds its fp32 sum once)
        tl.store(y_ptr + row * stride_y + ns, (y + acc).to(y_ptr.dtype.element_ty), mask=nmask)


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[rows, S*R]: each row's ``x @ A[slot]^T`` (zeros for slot -1), in x's dtype."""
    rows, k = x.shape
    sr = a.shape[1]
    out = torch.empty(rows, sr, dtype=x.dtype, device=x.device)
    block_r = min(next_pow2(sr), 16)
    _shrink_kernel[(rows, triton.cdiv(sr, block_r))](
        x, a, slots, out, k, sr, x.stride(0), a.stride(0), a.stride(1), out.stride(0),
        BLOCK_R=block_r, BLOCK_K=256, num_warps=4)
    return out


def lora_expand_triton_(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``y[row] += xa[row] @ B^T[slot]`` in place (nothing for slot -1); returns y."""
    rows, n = y.shape
    sr = b.shape[1]
    block_n = 128
    _expand_kernel[(rows, triton.cdiv(n, block_n))](
        xa, b, slots, y, sr, n, xa.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_R=min(next_pow2(sr), 64), BLOCK_N=block_n, num_warps=4)
    return y


def slot_mask(slots: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """The one-hot [rows, slots, 1] of each row's slot (all zeros for -1)."""
    ids = torch.arange(num_slots, device=slots.device)
    return (slots[:, None, None] == ids[None, :, None]).to(dtype)


def reference_lora_add_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                        mask: torch.Tensor = None) -> torch.Tensor:
    """The masked form (module docstring); ``mask``: ``slot_mask(slots, ...)`` when already made."""
    rows, n = x.shape[0], a.shape[0]
    mask = slot_mask(slots, n, x.dtype) if mask is None else mask
    xa = (x @ a.view(-1, a.shape[-1]).t()).view(rows, n, -1) * mask
    return y.addmm_(xa.view(rows, -1), b.view(-1, b.shape[-1]))


def lora_add_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
              mask=None) -> torch.Tensor:
    """``y [rows, out] += `` each row's LoRA product, in place (``x [rows, in]``; ``slots``
    int64 [rows]; ``mask``: a callable giving the rows' one-hot mask, made once a step and only
    where the torch form runs)."""
    if (use_triton(x) and x.dim() == y.dim() == 2 and x.shape[0] <= MAX_KERNEL_ROWS and x.stride(-1) == 1
            and y.stride(-1) == 1):
        return lora_expand_triton_(y, lora_shrink_triton(x, a, slots), b, slots)
    return reference_lora_add_(y, x, a, b, slots, None if mask is None else mask())
