"""RMSNorm and fused residual-add + RMSNorm with HF ``LlamaRMSNorm``'s numerics: the row
normalized in fp32, cast to the input dtype, times ``weight`` (rounded to the input dtype);
the fused form first rounds ``new_residual = x + residual`` to the input dtype, as HF does.
"""
from typing import Optional, Tuple

import torch

from .._common import (next_pow2, pdl_enabled, pdl_launch_dependents, pdl_launch_kwargs, pdl_wait, tl, triton,
                       unit_stride, use_triton)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
    EARLY_DEPS: tl.constexpr = False,
):
    if EARLY_DEPS:  # the next kernel (the TMA GEMV, streaming its weights meanwhile) launches now
        pdl_launch_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        dtype = r.dtype  # (an fp32 x, e.g. an MoE block's unrounded sum, is rounded to it first)
        x = (x.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    normed = rms_normalize(x, N, eps)
    pdl_launch_dependents(USE_PDL)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_normalize(x, N, eps):
    """One row [BLOCK] (masked entries 0) -> x / rms(x): statistics in fp32, the result
    rounded to x's dtype (the step before the weight multiply)."""
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    return (xf * tl.rsqrt(var + eps)).to(x.dtype)


def _launch(x, residual, weight, eps, early_dependents: bool = False):
    n = x.shape[-1]
    x2 = unit_stride(x.reshape(-1, n))
    rows = x2.shape[0]
    dt = x.dtype if residual is None else residual.dtype
    out = torch.empty(x.shape, dtype=dt, device=x.device)
    out2 = out.view(-1, n)
    if residual is not None:
        r2 = unit_stride(residual.reshape(-1, n))
        res_out = torch.empty(x.shape, dtype=dt, device=x.device)
        ro2 = res_out.view(-1, n)
    else:
        r2, res_out, ro2 = x2, None, out2
    if rows > 0:
        pdl = pdl_enabled(x2)
        block = next_pow2(n)
        num_warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out2, ro2,
            x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0),
            n, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps,
            USE_PDL=pdl, EARLY_DEPS=bool(early_dependents) and bool(pdl), **pdl_launch_kwargs(pdl),
        )
    return out, res_out


# ----------------------------------------------------------------- launchers
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    early_dependents: bool = False) -> torch.Tensor:
    """``early_dependents`` (PDL): the next kernel may launch as this one starts (the TMA
    GEMV of kernels/gemv/gemv_tma.py, which streams its weights before its wait)."""
    return _launch(x, None, weight, eps, early_dependents)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, early_dependents: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    assert x.shape == residual.shape and x.dtype in (residual.dtype, torch.float32)
    return _launch(x, residual, weight, eps, early_dependents)


# ---------------------------------------------------------------- references
def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    normed = (xf * torch.rsqrt(var + eps)).to(x.dtype)
    return (weight.float() * normed.float()).to(x.dtype)


def reference_fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return reference_rms_norm(new_residual, weight, eps), new_residual


# ------------------------------------------------------------------- public
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             early_dependents: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any leading shape); returns a new tensor.
    ``early_dependents``: see ``rms_norm_triton`` (CUDA only; ignored elsewhere)."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, early_dependents)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # torch's op computes the same fp32 expression in one call (the CPU path is
        # dominated by per-op overhead); lower precisions keep the reference's roundings
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    return reference_rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float = 1e-6,
    early_dependents: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``; ``residual=None`` (the first layer):
    ``(rms_norm(x), x)``. An fp32 ``x`` beside a lower-precision residual (an MoE fp32 sum) is
    rounded to the residual's dtype first. ``early_dependents``: see ``rms_norm_triton``."""
    if residual is None:
        return rms_norm(x, weight, eps, early_dependents), x
    if x.dtype != residual.dtype and not (use_triton(x) and x.dtype == torch.float32):
        x = x.to(residual.dtype)
    if use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps, early_dependents)
    if x.dtype == torch.float32:
        new_residual = x + residual
        return rms_norm(new_residual, weight, eps), new_residual
    return reference_fused_add_rms_norm(x, residual, weight, eps)
