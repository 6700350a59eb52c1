"""Integer-quantized weights as checkpoints store them, back to floats: the unpacking of 2-, 4-
and 8-bit codes from int32 words and the grouped dequantization ``(q - zero[g]) * scale[g]``.

The three layouts the loader reads (``loader/quantized.py``):

- compressed-tensors ``pack-quantized``: ``weight_packed`` int32 [out, in * bits / 32], code i of
  a word at bits ``i * bits`` (little end first), codes stored as ``q + 2 ** (bits - 1)``;
  ``weight_zero_point`` (asymmetric) packed the same way along the output dimension.
- GPTQ: ``qweight`` int32 [in * bits / 32, out] packed along the input dimension, ``qzeros``
  int32 [groups, out * bits / 32] along the output, unsigned codes, zeros stored as zero - 1
  (AutoGPTQ's format; ``sym`` checkpoints hold 2 ** (bits - 1) - 1), ``g_idx`` [in] the group
  of each input column (activation order).
- AWQ (GEMM): ``qweight`` int32 [in, out * bits / 32] and ``qzeros`` [groups, out * bits / 32],
  both along the output dimension, a word's eight codes in AutoAWQ's slot order (``AWQ_SLOT``).

The arithmetic runs in the scale's dtype, as compressed-tensors' and GPTQ's reference kernels
compute it, so a bf16 scale gives the bf16 weights those libraries give.
"""
from __future__ import annotations

from typing import Optional

import torch

# AutoAWQ's GEMM pack puts columns 0 2 4 6 1 3 5 7 of a group of eight in a word's slots 0..7:
# column j sits in slot AWQ_SLOT[j]
AWQ_SLOT = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: Optional[tuple] = None) -> torch.Tensor:
    """int32 words -> their ``32 // bits`` unsigned codes each (int32), along ``dim`` (0 or 1):
    code j of a word at bits ``j * bits``, or at ``order[j] * bits`` (AWQ_SLOT)."""
    if bits not in (2, 4, 8):
        raise ValueError(f"{bits}-bit weights are not supported (2, 4 and 8 are)")
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    if order is not None:
        shifts = torch.tensor(order, dtype=torch.int32) * bits
    x = packed.to(torch.int32)
    codes = (x.unsqueeze(-1) >> shifts) & ((1 << bits) - 1) if dim == 1 else \
        (x.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)
    return codes.reshape(x.shape[0], -1) if dim == 1 else codes.reshape(-1, x.shape[1])


def dequantize_grouped(q: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor] = None,
                       g_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Codes q [out, in] -> ``(q - zero) * scale`` in the scale's dtype. ``scale`` and ``zero``:
    [out, groups] (groups of in / groups consecutive columns, or column j's group ``g_idx[j]``),
    [out, 1] (a channel each) or one value (the tensor)."""
    out, cols = q.shape
    scale = scale.reshape(1, 1) if scale.numel() == 1 else scale.reshape(out, -1)
    if zero is not None:
        zero = zero.reshape(1, 1) if zero.numel() == 1 else zero.reshape(out, -1)
    groups = scale.shape[1]
    if groups > 1 or g_idx is not None:
        if g_idx is None:
            if cols % groups:
                raise ValueError(f"{cols} input columns do not split into {groups} groups")
            g_idx = torch.arange(cols) // (cols // groups)
        elif tuple(g_idx.shape) != (cols,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"g_idx of shape {tuple(g_idx.shape)} does not put {cols} columns in {groups} groups")
        g_idx = g_idx.long()
        scale = scale[:, g_idx]
        zero = None if zero is None else zero[:, g_idx]
    w = q.to(scale.dtype)
    return (w if zero is None else w - zero.to(scale.dtype)) * scale


def q4_blocks(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> Optional[tuple]:
    """Unsigned 4-bit codes q [N, K] with ``(q - zero) * scale`` per group of consecutive columns
    (scale / zero [N, groups], a group a multiple of 32 wide) as GGUF Q4_1 blocks of 32 for the CPU
    kernels (``kernels/cpu_quant``): (q uint8, d fp16 [N, K/32], m fp16 [N, K/32]) with
    w = d q + m, d = scale and m = -zero * scale rounded to fp16 (exact where zero * scale is an
    fp16 value, as for symmetric codes: zero 8), or None where a group is not a multiple of 32."""
    n, k = q.shape
    per = k // scale.shape[1]
    if per % 32 or per * scale.shape[1] != k:
        return None
    rep = per // 32
    d = scale.float().repeat_interleave(rep, 1)
    m = -(zero.float().repeat_interleave(rep, 1) * d)
    return q.to(torch.uint8), d.half(), m.half()


def q8_blocks(q: torch.Tensor, scale: torch.Tensor) -> Optional[tuple]:
    """Signed 8-bit codes q [N, K] with ``q * scale`` (scale [N, groups], a group a multiple of 32
    wide) as GGUF Q8_0 blocks: (q int8, d fp16 [N, K/32]), or None where a group is not."""
    per = q.shape[1] // scale.shape[1]
    if per % 32 or per * scale.shape[1] != q.shape[1]:
        return None
    return q.to(torch.int8), scale.float().repeat_interleave(per // 32, 1).half()
