"""Block-FP8 weights with 16-bit activations (``weight_dtype='fp8'``): float8 e4m3 values and one
fp32 scale per [bn, bk] block (DeepSeek's layout and recipe, scale = block amax / 448), and the
Triton linear that dequantizes each tile in its K loop exactly as ``dequantize`` does. Knows
nothing about checkpoints (docs/models.md#fp8-any-device).
"""
from __future__ import annotations

import itertools
from typing import Optional

import torch
import torch.nn.functional as F

from ._common import device_sms, tl, triton, unit_stride, use_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
DEFAULT_BLOCK = (128, 128)
# the block weight_dtype='fp8' quantizes with where the checkpoint names none (an FP8 checkpoint's
# own ``weight_block_size`` is kept: its values then come back exactly); tests set smaller ones
WEIGHT_BLOCK = DEFAULT_BLOCK
FP8_LINEAR_MAX_ROWS = 64  # more rows (prefill): the weight dequantized once, then cuBLAS


def quantize_fp8_block(w: torch.Tensor, block: tuple = DEFAULT_BLOCK, pow2: bool = False) -> tuple:
    """(q float8 [..., N, K], scale fp32 [..., ceil(N / bn), ceil(K / bk)]), w ~ q * scale
    blockwise; an all-zero block gets scale 1; ``pow2``: scales rounded up to powers of two
    (ue8m0). One leading index at a time (fp32 temporaries of one matrix)."""
    bn, bk = block
    *lead, n, k = w.shape
    gn, gk = -(-n // bn), -(-k // bk)
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    s = torch.empty(*lead, gn, gk, dtype=torch.float32, device=w.device)
    for idx in itertools.product(*(range(d) for d in lead)):
        m = F.pad(w[idx].float(), (0, gk * bk - k, 0, gn * bn - n)).view(gn, bn, gk, bk)
        amax = m.abs().amax(dim=(1, 3))
        sc = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        if pow2:
            sc = torch.exp2(torch.ceil(torch.log2(sc)))
        qm = (m / sc[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        q[idx] = qm.view(gn * bn, gk * bk)[:n, :k]
        s[idx] = sc
    return q, s


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """The scale grid as fp32 multipliers: floats as they are; E8M0 exponents (stored as
    uint8 or float8_e8m0fnu, 2 ** (byte - 127)) unpacked."""
    if scale.dtype == torch.uint8 or str(scale.dtype) == "torch.float8_e8m0fnu":
        return torch.exp2(scale.view(torch.uint8).to(torch.float32) - 127.0)
    if not scale.dtype.is_floating_point:
        raise ValueError(f"FP8 weight scales must be floating point or E8M0 bytes, got {scale.dtype}")
    return scale.to(torch.float32)


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         name: str = "weight") -> torch.Tensor:
    """fp32 ``weight * scale_inv`` with one scale per [block] tile of the weight's last two
    dims (leading dims, as stacked experts', are batch); the grid may round up."""
    if weight.dim() < 2:
        raise ValueError(f"FP8 tensor {name} has shape {tuple(weight.shape)}; block scales need a matrix")
    bn, bk = block
    n, k = weight.shape[-2:]
    grid = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape[-2:]) != grid or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise ValueError(f"FP8 tensor {name}: scale grid {tuple(scale_inv.shape)} does not fit weight "
                         f"{tuple(weight.shape)} in blocks of {bn}x{bk} (expected {weight.shape[:-2] + grid})")
    s = scale_values(scale_inv)
    s = s.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return weight.to(torch.float32) * s


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The weight in ``dtype``: q * scale blockwise, formed in fp32, then rounded once."""
    return dequantize_fp8_block(q, scale, block).to(dtype)


def reference_fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple,
                         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return F.linear(x, dequantize(q, scale, block, x.dtype), None if bias is None else bias.to(x.dtype))


@triton.jit
def _fp8_linear_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                       BN_Q: tl.constexpr, BK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    """y [M, N] = x [M, K] . dequantize(q, s)^T (+ bias): one [BLOCK_M, BLOCK_N] tile per program."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    q_ptrs = q_ptr + offs_n.to(tl.int64)[None, :] * stride_qn + offs_k[:, None]
    s_ptrs = s_ptr + (offs_n // BN_Q) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(q_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k
            a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(q_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        sc = tl.load(s_ptrs + k // BK_Q, mask=n_ok, other=0.0)  # (BLOCK_K divides BK_Q: one scale column)
        w = (w.to(tl.float32) * sc[None, :]).to(a.dtype)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_block_k(block: tuple) -> Optional[int]:
    """The K tile the kernels take for scale blocks ``block`` (a divisor of bk, at most 128,
    at least 16), or None where bk has none (those layers dequantize and use torch)."""
    return next((t for t in (128, 64, 32, 16) if block[1] % t == 0), None)


def fp8_linear_ok(x: torch.Tensor, q: torch.Tensor, block: tuple) -> bool:
    """Whether ``fp8_linear`` runs the Triton kernel: CUDA tensors (Triton installed), up to
    FP8_LINEAR_MAX_ROWS rows, 16-bit or fp32 x, a usable K tile."""
    rows = x.numel() // max(1, x.shape[-1])
    return (use_triton(x) and rows <= FP8_LINEAR_MAX_ROWS and fp8_block_k(block) is not None
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


def fp8_linear_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple,
                      bias: Optional[torch.Tensor] = None, sms: Optional[int] = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype through ``_fp8_linear_kernel``."""
    K = x.shape[-1]
    N = q.shape[0]
    x2 = unit_stride(x.reshape(-1, K))
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y.view(*x.shape[:-1], N)
    block_k = fp8_block_k(block)
    block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
    sms = sms or device_sms(x)
    block_n = 64  # narrower tiles where 64-row ones would leave SMs idle (decode: N / 64 programs)
    while block_n > 16 and triton.cdiv(N, block_n) * triton.cdiv(M, block_m) < sms:
        block_n //= 2
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _fp8_linear_kernel[grid](x2, q, scale, bias if bias is not None else q, y, M, N, K,
                             x2.stride(0), q.stride(0), scale.stride(0), y.stride(0),
                             BN_Q=block[0], BK_Q=block[1], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                             EVEN_K=K % block_k == 0, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                             num_warps=4, num_stages=4)
    return y.view(*x.shape[:-1], N)


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x . dequantize(q, scale)^T (+ bias) in x's dtype: the Triton kernel where
    ``fp8_linear_ok``, else the weight dequantized once and ``F.linear``."""
    fn = fp8_linear_triton if fp8_linear_ok(x, q, block) else reference_fp8_linear
    return fn(x, q, scale, block, bias)

