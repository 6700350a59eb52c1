"""One-shot all-reduce fused with the residual add and RMSNorm (tensor parallelism): reads every
rank's partial sums from buffers all ranks can read, sums them in fp32 in rank order
(bit-identical on every rank) and normalizes as ``kernels/norm/rmsnorm.py``. Synchronising
the ranks around the buffers is the caller's job.
"""
from typing import Optional, Sequence, Tuple

import torch

from .._common import next_pow2, tl, triton, unit_stride
from .rmsnorm import reference_fused_add_rms_norm, reference_rms_norm, rms_normalize


@triton.jit
def _oneshot_allreduce_rmsnorm_kernel(
    ptrs_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_r, stride_o, stride_ro, N, eps,
    WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = res_out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        base = tl.load(ptrs_ptr + r).to(tl.pointer_type(dtype))
        acc += tl.load(base + row * N + cols, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
    x = acc.to(dtype)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
    tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = rms_normalize(x, N, eps).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def oneshot_allreduce_rms_norm_triton(
    ptrs: torch.Tensor, rows: int, n: int, residual: Optional[torch.Tensor], weight: torch.Tensor,
    eps: float, dtype: torch.dtype,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``ptrs`` [world] int64 on the device, rank 0's first: each rank's buffer of ``rows`` x ``n``
    contiguous ``dtype`` partial sums (any memory under the interpreter). One program per row:
    x = sum_r partial_r rounded; new_residual = x + residual (x without one); out =
    rms_norm(new_residual) * weight. Returns ``(normed, new_residual)``, both [rows, n]."""
    dev = ptrs.device
    res_out = torch.empty(rows, n, dtype=dtype, device=dev)
    out = torch.empty(rows, n, dtype=dtype, device=dev)
    r2 = unit_stride(residual.reshape(rows, n)) if residual is not None else res_out
    if rows > 0:
        block = next_pow2(n)
        num_warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
        _oneshot_allreduce_rmsnorm_kernel[(rows,)](
            ptrs, r2, weight, out, res_out, r2.stride(0), out.stride(0), res_out.stride(0), n, float(eps),
            WORLD=ptrs.numel(), HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps)
    return out, res_out


def reference_allreduce_add_rms_norm(
    partials: Sequence[torch.Tensor], residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ranks' partial sums added in rank order in fp32 and rounded, then the residual
    add and RMSNorm of ``kernels/norm/rmsnorm.py``: ``(normed, new_residual)``."""
    acc = partials[0].float().clone()
    for p in partials[1:]:
        acc += p.float()
    x = acc.to(partials[0].dtype)
    if residual is None:
        return reference_rms_norm(x, weight, eps), x
    return reference_fused_add_rms_norm(x, residual, weight, eps)
