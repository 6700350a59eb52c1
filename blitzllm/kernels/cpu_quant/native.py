"""Our AVX-512 kernels for GGUF blocks (``qgemm.c``, built and loaded by ``kernels/_cbuild.py``),
called through ctypes. ``lib()`` is None where the CPU lacks AVX-512, no compiler builds the
file, or ``BLITZ_CPU_QGEMM=0``: ``pack.py`` then packs for torch's int4 kernel instead.

Why our own: torch's int4 CPU kernel is fast only with bf16 activations and bf16 scales, and
those roundings flip near-tie greedy tokens against the fp32 model (issue 38: 5 of 12 chat
answers equal over 48 tokens). These kernels read the file's codes and fp16 scales as they are
and compute in fp32: the fp32 matmul with the dequantized weight, up to summation order.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from .. import _cbuild

_P, _I = ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {"blitz_q4_gemm": ([_P] * 5 + [_I] * 4, _I), "blitz_q8_gemm": ([_P] * 4 + [_I] * 4, _I),
               "blitz_dense_gemm": ([_P] * 3 + [_I] * 5, _I),
               "blitz_q4_dequant": ([_P] * 4 + [_I] * 3, None), "blitz_q8_dequant": ([_P] * 3 + [_I] * 3, None)}
_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
_state: dict = {}


def lib() -> Optional[ctypes.CDLL]:
    """The loaded kernels, or None (see the module docstring)."""
    if "lib" not in _state:
        from ... import envs
        src = Path(__file__).with_name("qgemm.c")
        needs = ("avx512f", "avx512bw", "fma", "f16c")
        # (AVX512-VBMI where the CPU has it: the q4 kernel spreads two groups' codes in one permute)
        flags = _FLAGS + (("-mavx512vbmi",) if "avx512vbmi" in _cbuild.cpu_flags() else ())
        _state["lib"] = _cbuild.load(src, flags, needs, _SIGNATURES) if envs.get("BLITZ_CPU_QGEMM") else None
    return _state["lib"]


def matmul(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] fp32 contiguous -> x @ W.T [M, N] fp32; q4 when ``codes`` is uint8 [N, K/2]
    (with ``m``), q8 when int8 [N, K]; ``d`` / ``m`` fp16 [N, K/32]; a dense weight [N, K] when
    ``codes`` is bfloat16 or float32 (``d``, ``m`` None)."""
    M, K = x.shape
    N = codes.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    threads = torch.get_num_threads()
    if codes.dtype in (torch.bfloat16, torch.float32):
        rc = _state["lib"].blitz_dense_gemm(x.data_ptr(), codes.data_ptr(), y.data_ptr(), M, N, K,
                                            int(codes.dtype == torch.float32), threads)
    elif codes.dtype == torch.uint8:
        rc = _state["lib"].blitz_q4_gemm(x.data_ptr(), codes.data_ptr(), d.data_ptr(), m.data_ptr(), y.data_ptr(),
                                         M, N, K, threads)
    else:
        rc = _state["lib"].blitz_q8_gemm(x.data_ptr(), codes.data_ptr(), d.data_ptr(), y.data_ptr(), M, N, K,
                                         threads)
    if rc:
        raise ValueError(f"GGUF block matmul: unsupported K={K} (a multiple of 32 up to 32768)")
    return y


def dequantize(codes: torch.Tensor, d: torch.Tensor, m: Optional[torch.Tensor]) -> torch.Tensor:
    """The fp32 weight [N, K] of ``matmul``'s operands."""
    N = codes.shape[0]
    K = codes.shape[1] * (2 if codes.dtype == torch.uint8 else 1)
    w = torch.empty(N, K, dtype=torch.float32)
    threads = torch.get_num_threads()
    if codes.dtype == torch.uint8:
        _state["lib"].blitz_q4_dequant(codes.data_ptr(), d.data_ptr(), m.data_ptr(), w.data_ptr(), N, K, threads)
    else:
        _state["lib"].blitz_q8_dequant(codes.data_ptr(), d.data_ptr(), w.data_ptr(), N, K, threads)
    return w


@torch.library.custom_op("blitz::gguf_matmul", mutates_args=())
def gguf_matmul_op(x: torch.Tensor, codes: torch.Tensor, d: Optional[torch.Tensor],
                   m: Optional[torch.Tensor]) -> torch.Tensor:
    """``matmul`` as an op torch.compile can trace (runner/cpu_graph.py's compiled form)."""
    return matmul(x.contiguous(), codes, d, m)


@gguf_matmul_op.register_fake
def _(x, codes, d, m):
    return x.new_empty(x.shape[0], codes.shape[0])


def gemm_addresses() -> tuple:
    """(blitz_q4_gemm, blitz_q8_gemm, blitz_dense_gemm) as addresses, for C callers (kernels/cpu_decode)."""
    return tuple(ctypes.cast(getattr(lib(), n), ctypes.c_void_p).value
                 for n in ("blitz_q4_gemm", "blitz_q8_gemm", "blitz_dense_gemm"))
