"""bf16 GEMMs on the CPU through oneDNN's packed weights (torch's mkldnn ops, as inductor's CPU
freezing uses them). torch's ``F.linear`` on a plain bf16 weight reorders it for oneDNN on every
call; packed once, the same products, bit for bit, take about half the time at decode's row
counts (a 3072 x 576 weight: 159 -> 82 us at 16 rows, 127 -> 74 us at one) and less at
prefill's (351 -> 256 us at 128 rows). The reference is ``F.linear`` on the plain weight."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def pack(w: torch.Tensor) -> Optional[torch.Tensor]:
    """oneDNN's packed form of a bf16 weight [N, K] (an opaque mkldnn tensor), or None where
    torch lacks it or its products differ from ``reference_linear``'s."""
    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        wp = torch.ops.mkldnn._reorder_linear_weight(w.detach())
        x = torch.randn(3, w.shape[1], dtype=w.dtype)
        return wp if torch.equal(linear(x, wp), reference_linear(x, w)) else None
    except (RuntimeError, AttributeError):
        return None


def linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] bf16 @ W.T (+ bias) with W packed by ``pack``."""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])


def reference_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return F.linear(x, w, bias)
