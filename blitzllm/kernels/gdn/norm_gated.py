"""The GDN layer's output norm in one launch: w * rmsnorm(x) * silu(z) per value head
(transformers' ``RMSNormGated``), with the roundings of ``reference.reference_rms_norm_gated``.
Rows are (token, head) pairs of x [..., D] and of z, which may be a strided view of the packed
projection output; a program normalizes ROWS of them.
"""
from __future__ import annotations

import torch

from .._common import next_pow2, tl, triton


@triton.jit
def _rms_norm_gated_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr,
    R, H, D, stride_xt, stride_xh, stride_zt, stride_zh, eps,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    # (t, h) rather than one row stride: z's heads are contiguous inside a projection row
    # whose stride is the projection's width
    t = rows // H
    h = rows - t * H
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + (t * stride_xt + h * stride_xh)[:, None] + cols[None, :], mask=mask, other=0.0)
    z = tl.load(z_ptr + (t * stride_zt + h * stride_zh)[:, None] + cols[None, :], mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
    dt = x.dtype
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
    # the reference rounds to x's dtype twice before the gate: after the norm and after the
    # weight (a multiply in that dtype: exact in fp32, then one rounding)
    n = (xf * rstd[:, None]).to(dt).to(tl.float32)
    y = (w.to(dt).to(tl.float32)[None, :] * n).to(dt).to(tl.float32)
    zf = z.to(tl.float32)
    y = y * (zf * tl.sigmoid(zf))
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], y.to(dt), mask=mask)


def _as_heads(t: torch.Tensor, D: int) -> torch.Tensor:
    """t as [T, H, D] without a copy where its leading dims allow it."""
    if t.dim() == 1:
        return t.view(1, 1, D)
    if t.dim() == 2:
        return t[None]
    return t.reshape(-1, t.shape[-2], D)


def rms_norm_gated_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * rmsnorm(x) * silu(z) over the last dim, in x's dtype. x and z [..., D] with the
    last dim contiguous (z may be strided otherwise: a view of the projection output);
    weight [D]."""
    D = x.shape[-1]
    assert z.shape == x.shape and weight.shape == (D,), (tuple(x.shape), tuple(z.shape), tuple(weight.shape))
    assert x.stride(-1) == 1 and z.stride(-1) == 1 and weight.stride(0) == 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x3, z3 = _as_heads(x, D), _as_heads(z, D)
    R, H = x3.shape[0] * x3.shape[1], x3.shape[1]
    if R == 0:
        return out
    block_d = next_pow2(D)
    # ~2K elements a program: at D = 128 (16 rows, 4 warps) prefill sizes stream at ~3 TB/s on
    # an H100, where one row a program gets 40% of that; fewer rows when there are few (decode)
    rows = min(max(1, 2048 // block_d), next_pow2(R))
    _rms_norm_gated_kernel[(triton.cdiv(R, rows),)](
        x3, z3, weight, out, R, H, D, x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1), float(eps),
        ROWS=rows, BLOCK_D=block_d, num_warps=4 if rows * block_d >= 1024 else 2)
    return out
