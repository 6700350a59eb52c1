"""SwiGLU gate ``silu(x[..., :I]) * x[..., I:]`` with the HF MLP's numerics: silu in fp32
rounded to the input dtype, then times ``up`` (the product rounded to the input dtype).
"""
import torch
import torch.nn.functional as F

from ._common import next_pow2, tl, triton, unit_stride, use_triton


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    two_i = x.shape[-1]
    assert two_i % 2 == 0, "last dim must be 2 * intermediate_size"
    inter = two_i // 2
    x2 = unit_stride(x.reshape(-1, two_i))
    out = torch.empty(x.shape[:-1] + (inter,), dtype=x.dtype, device=x.device)
    o2 = out.view(-1, inter)
    rows = x2.shape[0]
    if rows > 0 and inter > 0:
        block = min(next_pow2(inter), 2048)
        grid = (rows, triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](x2, o2, x2.stride(0), o2.stride(0), inter,
                                   BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return out


def reference_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    return F.silu(x[..., :inter]) * x[..., inter:]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2I] -> [..., I]``: first half gate, second half up."""
    fn = silu_and_mul_triton if use_triton(x) else reference_silu_and_mul
    return fn(x)
