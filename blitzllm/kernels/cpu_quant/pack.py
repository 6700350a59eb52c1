"""Packing GGUF blocks for torch's int4 CPU kernel (``_weight_int4pack_mm_for_cpu``), which
computes ``x @ w.T`` with w = (q - 8) * scale + zero per group of 32 input columns, q in 0..15.

- Q4_1 (w = d q + m): scale d, zero m + 8 d; Q4_0 (w = d (q - 8)): scale d, zero 0.
- Q8_0 (w = d q, q in -128..127): q + 128 = 16 h + l with h, l in 0..15, so w is the sum of two
  4-bit matrices, (h - 8) 16 d and (l - 8) d + 8 d: two kernel calls over the same input.

The 4-bit codes are the file's. The kernel is fast only in bf16 (AVX512-BF16 / AMX; its fp32 and
fp16 forms measured 10x and 25x slower on the lm_head here), so scales and zeros are rounded to
bf16 (a relative 2^-9 of each weight's scale, against the 4-bit step of 1/15 of a group's range)
and the activations enter it rounded to bf16; it accumulates in fp32. Many rows (prefill) take
torch's bf16 GEMM on the weight widened from the codes (each weight then rounded to bf16 too).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

GROUP = 32
KERNEL_DTYPE = torch.bfloat16
# from this many rows (prefill) the weight is widened to bf16 from its codes and multiplied by
# torch's bf16 GEMM: at 1,000 rows x [3072, 576] (one thread) 4.8 + 10.6 ms against the int4
# kernel's 74 ms; at 128 rows 6.4 against 8.3 ms
MANY_ROWS = 128


@dataclass
class QuantWeight:
    """One linear's packed weight: ``parts`` of (packed int4, scales_zeros [K/32, N, 2] fp32),
    summed (two for Q8_0 blocks); ``out_features`` N."""
    parts: list
    out_features: int
    codes: list = None  # per part: the 4-bit codes two to a byte [N, K/2] (even k low), for many rows

    def nbytes(self) -> int:
        """Bytes a decode step reads (the kernel's parts)."""
        return sum(p.numel() * p.element_size() + sz.numel() * sz.element_size() for p, sz in self.parts)

    def dequantize(self, dtype=torch.bfloat16) -> torch.Tensor:
        """The weight [N, K] from the codes and the parts' scales and zeros (fp32 sum, then dtype)."""
        w = None
        for nib, (_, sz) in zip(self.codes, self.parts):
            n, half = nib.shape
            q = torch.stack([nib & 15, nib >> 4], -1).view(n, half * 2 // GROUP, GROUP).to(sz.dtype)
            s, z = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]
            part = ((q - 8) * s + z).view(n, half * 2)
            w = part if w is None else w.float() + part
        return w.to(dtype)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def _pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple:
    """q [N, K] integers 0..15, scale / zero [N, K/32] -> (packed, scales_zeros [K/32, N, 2])."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    sz = torch.stack([scale.float(), zero.float()], -1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)
    return packed, sz


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: Optional[torch.Tensor]) -> QuantWeight:
    """Q4_1 (``m`` given) or Q4_0 (``m`` None) groups: q [N, K] in 0..15, d / m [N, K/32]."""
    d = d.float()
    zero = torch.zeros_like(d) if m is None else m.float() + 8 * d
    return QuantWeight([_pack(q, d, zero)], q.shape[0], [_nibbles(q)])


def pack_q8_blocks(q: torch.Tensor, d: torch.Tensor) -> QuantWeight:
    """Q8_0 blocks: q [N, K] int8, d [N, K/32] -> two 4-bit parts whose sum is d q."""
    u = q.to(torch.int32) + 128
    d = d.float()
    hi = _pack(u >> 4, 16 * d, torch.zeros_like(d))
    lo = _pack(u & 15, d, 8 * d)
    return QuantWeight([hi, lo], q.shape[0], [_nibbles(u >> 4), _nibbles(u & 15)])


def int4_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [..., K] -> x @ W.T [..., N] in x's dtype (computed from x rounded to bf16)."""
    x2 = x.reshape(-1, x.shape[-1]).to(KERNEL_DTYPE)
    if x2.shape[0] >= MANY_ROWS and w.codes is not None:
        return F.linear(x2, w.dequantize(KERNEL_DTYPE)).to(x.dtype).view(*x.shape[:-1], w.out_features)
    y = None
    for packed, sz in w.parts:
        part = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, GROUP, sz)
        y = part.float() if y is None else y.add_(part)
    return y.to(x.dtype).view(*x.shape[:-1], w.out_features)


def reference_dequantize(q: torch.Tensor, d: torch.Tensor, m: Optional[torch.Tensor] = None,
                         kind: str = "q4") -> torch.Tensor:
    """The GGUF formula in fp32: q4 with m: d q + m; q4 without: d (q - 8); q8: d q."""
    n, k = q.shape
    qf = q.float().view(n, k // GROUP, GROUP)
    if kind == "q8":
        w = qf * d.float()[..., None]
    elif m is None:
        w = (qf - 8) * d.float()[..., None]
    else:
        w = qf * d.float()[..., None] + m.float()[..., None]
    return w.view(n, k)


def reference_matmul(x: torch.Tensor, w_dequantized: torch.Tensor) -> torch.Tensor:
    return x @ w_dequantized.to(x.dtype).t()
