"""bf16 GEMMs on the CPU: oneDNN's packed weights (torch's mkldnn ops, as inductor's CPU
freezing uses them) and, for one row (batch-1 decode), our AVX512-BF16 loop over the plain
weight (``gemv_bf16.c``). torch's ``F.linear`` on a plain bf16 weight reorders it for oneDNN on
every call; packed once, the same products, bit for bit, take about half the time at decode's
row counts (a 3072 x 576 weight: 159 -> 82 us at 16 rows, 127 -> 74 us at one) and less at
prefill's (351 -> 256 us at 128 rows). At one row our loop reads the weights faster still
(``matmul`` picks); from two rows oneDNN's (AMX) is as fast or faster. The reference is
``F.linear`` on the plain weight."""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from .. import _cbuild

_P, _I = ctypes.c_void_p, ctypes.c_int
_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC")
_state: dict = {}


def gemv_lib() -> Optional[ctypes.CDLL]:
    """``gemv_bf16.c`` loaded, or None (no AVX512-BF16, no compiler)."""
    if "lib" not in _state:
        sig = {"blitz_gemv_bf16": ([_P] * 4 + [_I] * 3, None)}
        _state["lib"] = _cbuild.load(Path(__file__).with_name("gemv_bf16.c"), _FLAGS,
                                     ("avx512f", "avx512bw", "avx512_bf16"), sig)
    return _state["lib"]


def gemv_address() -> int:
    """blitz_gemv_bf16's address, for C callers (kernels/cpu_decode); ``gemv_lib`` must be loaded."""
    return ctypes.cast(gemv_lib().blitz_gemv_bf16, ctypes.c_void_p).value


def gemv(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [1, K] (or [K]) bf16 @ W.T (+ bias) -> [1, N] bf16 with W [N, K] bf16 contiguous, by
    ``gemv_lib`` (which must be loaded): fp32 sums rounded once, as ``reference_linear``'s."""
    N, K = w.shape
    x = x.reshape(1, K).contiguous()
    y = torch.empty(1, N, dtype=torch.bfloat16)
    gemv_lib().blitz_gemv_bf16(x.data_ptr(), w.data_ptr(), None if bias is None else bias.data_ptr(),
                               y.data_ptr(), N, K, torch.get_num_threads())
    return y


def matmul(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None):
    """x [..., K] bf16 @ W.T (+ bias): one row by ``gemv`` where it loads, else oneDNN's packed GEMM."""
    if x.numel() == x.shape[-1] and w.is_contiguous() and gemv_lib() is not None:
        return gemv(x, w, bias).view(*x.shape[:-1], w.shape[0])
    return linear(x, packed, bias)


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
