"""GGUF blocks kept as they are on the CPU (``QuantWeight``) and their matmul.

Each group of 32 input columns of an output row has its codes and fp16 scales, as the file:
Q4_1 w = d q + m (q in 0..15), Q4_0 w = d (q - 8) (held as m = -8 d), Q8_0 w = d q (q in
-128..127). Two kernels compute ``x @ W.T``:

- ours (``native.py``, AVX-512, the default where it builds): fp32 from the codes and fp16
  scales as they are, so the fp32 matmul with the dequantized weight;
- torch's int4 CPU kernel (``_weight_int4pack_mm_for_cpu``, where ours is unavailable): w =
  (q - 8) * scale + zero per group, so Q4_1 is scale d, zero m + 8 d; Q8_0 (q + 128 = 16 h + l)
  the sum of two 4-bit matrices (h - 8) 16 d and (l - 8) d + 8 d. It is fast only in bf16 (its
  fp32 form measured 10x slower), so activations, scales and outputs are rounded to bf16.

From ``MANY_ROWS`` rows (prefill) the weight is dequantized and multiplied by torch's dense GEMM
(fp32 with ours, bf16 with torch's kernel): compute bound there, a dense GEMM wins.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import native

GROUP = 32
KERNEL_DTYPE = torch.bfloat16   # torch's int4 kernel's fast form
MANY_ROWS = 32


@dataclass
class QuantWeight:
    """One linear's blocks. ``codes``: q4 uint8 [N, K/2], each group's 16 bytes holding its codes
    j and j + 16 in the low and high nibble (the file's order); q8 int8 [N, K]. ``d`` / ``m``
    fp16 [N, K/32] (``m`` None for q8). ``parts``: torch's int4 packing, (packed, scales_zeros
    [K/32, N, 2] bf16) per 4-bit matrix summed, only where our kernel is unavailable."""
    codes: torch.Tensor
    d: torch.Tensor
    m: Optional[torch.Tensor]
    parts: Optional[list] = None

    @property
    def kind(self) -> str:
        return "q4" if self.codes.dtype == torch.uint8 else "q8"

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    def nbytes(self) -> int:
        """Bytes a decode step reads."""
        if self.parts is not None:
            return sum(p.numel() * p.element_size() + sz.numel() * sz.element_size() for p, sz in self.parts)
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m) if t is not None)

    def codes_int(self) -> torch.Tensor:
        """The integer codes [N, K] (q4 0..15, q8 -128..127)."""
        if self.kind == "q8":
            return self.codes
        n = self.codes.shape[0]
        c = self.codes.view(n, -1, 16)
        return torch.cat([c & 15, c >> 4], -1).view(n, -1)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """The weight [N, K]: exact in fp32 (each code times its fp16 scale plus its fp16 zero)."""
        if self.parts is None:
            return native.dequantize(self.codes, self.d, self.m).to(dtype)
        return reference_dequantize(self.codes_int(), self.d, self.m, self.kind).to(dtype)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15 -> the file's layout: per group, byte j = q[j] | q[j + 16] << 4."""
    n = q.shape[0]
    g = q.to(torch.uint8).view(n, -1, 2, 16)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, -1).contiguous()


def _half(t: torch.Tensor) -> torch.Tensor:
    h = t.to(torch.float16)
    if not torch.equal(h.float(), t.float()):
        raise ValueError("GGUF block scales are fp16 values; these are not")
    return h.contiguous()


def _torch_part(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple:
    """q [N, K] in 0..15, scale / zero [N, K/32] -> (packed, scales_zeros [K/32, N, 2])."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    sz = torch.stack([scale.float(), zero.float()], -1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)
    return packed, sz


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: Optional[torch.Tensor]) -> QuantWeight:
    """Q4_1 (``m`` given) or Q4_0 (``m`` None) groups: q [N, K] in 0..15, d / m [N, K/32] (fp16 values)."""
    d = _half(d)
    m = _half(-8 * d.float()) if m is None else _half(m)
    w = QuantWeight(_nibbles(q), d, m)
    if native.lib() is None:
        w.parts = [_torch_part(q, d, m.float() + 8 * d.float())]
    return w


def pack_q8_blocks(q: torch.Tensor, d: torch.Tensor) -> QuantWeight:
    """Q8_0 blocks: q [N, K] int8, d [N, K/32] (fp16 values)."""
    d = _half(d)
    w = QuantWeight(q.to(torch.int8).contiguous(), d, None)
    if native.lib() is None:
        u, df = q.to(torch.int32) + 128, d.float()
        w.parts = [_torch_part(u >> 4, 16 * df, torch.zeros_like(df)), _torch_part(u & 15, df, 8 * df)]
    return w


def quant_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [..., K] -> x @ W.T [..., N] in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] >= MANY_ROWS:
        dt = torch.float32 if w.parts is None else KERNEL_DTYPE
        y = F.linear(x2.to(dt), w.dequantize(dt))
    elif w.parts is None:
        y = native.matmul(x2.float().contiguous(), w.codes, w.d, w.m)
    else:
        xb = x2.to(KERNEL_DTYPE)
        y = None
        for packed, sz in w.parts:
            part = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, GROUP, sz)
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
