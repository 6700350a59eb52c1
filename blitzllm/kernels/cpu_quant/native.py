"""Our AVX-512 kernels for GGUF blocks (``qgemm.c``): built on first use with the system C
compiler into ``~/.cache/blitzllm/kernels`` (the file named by the source's hash, so a warm cache
loads in milliseconds), called through ctypes, threaded with the OpenMP runtime torch already
loaded. ``lib()`` is None where the CPU lacks AVX-512, no compiler builds the file, or
``BLITZ_CPU_QGEMM=0``: ``pack.py`` then packs for torch's int4 kernel instead.

Why our own: torch's int4 CPU kernel is fast only with bf16 activations and bf16 scales, and
those roundings flip near-tie greedy tokens against the fp32 model (issue 38: 5 of 12 chat
answers equal over 48 tokens). These kernels read the file's codes and fp16 scales as they are
and compute in fp32: the fp32 matmul with the dequantized weight, up to summation order.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("qgemm.c")
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
_CPU_FLAGS = ("avx512f", "avx512bw", "fma", "f16c")
_lock = threading.Lock()
_state: dict = {}


def _cpu_supports() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(_CPU_FLAGS) <= set(line.split())


def _cache_dir() -> Path:
    from ... import envs
    root = envs.get("BLITZ_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "blitzllm"


def _build() -> Optional[ctypes.CDLL]:
    cc = os.environ.get("CC", "gcc")
    source = _SRC.read_bytes()
    key = hashlib.sha256(source + " ".join([cc] + _FLAGS).encode()).hexdigest()[:16]
    out = _cache_dir() / "kernels" / f"qgemm-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            so = Path(tmp) / out.name
            r = subprocess.run([cc, *_FLAGS, str(_SRC), "-o", str(so)], capture_output=True, text=True)
            if r.returncode != 0:
                log.warning("the AVX-512 GGUF kernels did not build (%s): torch's int4 kernel instead\n%s",
                            cc, r.stderr[-2000:])
                return None
            os.replace(so, out)  # (atomic: a concurrent process loads a whole file or builds its own)
    lib = ctypes.CDLL(str(out))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.blitz_q4_gemm.argtypes = [p, p, p, p, p, i, i, i, i]
    lib.blitz_q8_gemm.argtypes = [p, p, p, p, i, i, i, i]
    lib.blitz_q4_dequant.argtypes = [p, p, p, p, i, i, i]
    lib.blitz_q8_dequant.argtypes = [p, p, p, i, i, i]
    lib.blitz_q4_dequant.restype = lib.blitz_q8_dequant.restype = None
    return lib


def lib() -> Optional[ctypes.CDLL]:
    """The loaded kernels, or None (see the module docstring)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                from ... import envs
                ok = envs.get("BLITZ_CPU_QGEMM") and _cpu_supports()
                try:
                    _state["lib"] = _build() if ok else None
                except OSError as e:  # (no compiler on PATH, an unwritable cache, ...)
                    log.warning("the AVX-512 GGUF kernels are unavailable (%s): torch's int4 kernel instead", e)
                    _state["lib"] = None
    return _state["lib"]


def matmul(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] fp32 contiguous -> x @ W.T [M, N] fp32; q4 when ``codes`` is uint8 [N, K/2]
    (with ``m``), q8 when int8 [N, K]; ``d`` / ``m`` fp16 [N, K/32]."""
    M, K = x.shape
    N = codes.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    threads = torch.get_num_threads()
    if codes.dtype == torch.uint8:
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
def gguf_matmul_op(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: Optional[torch.Tensor]) -> torch.Tensor:
    """``matmul`` as an op torch.compile can trace (runner/cpu_graph.py's compiled form)."""
    return matmul(x.contiguous(), codes, d, m)


@gguf_matmul_op.register_fake
def _(x, codes, d, m):
    return x.new_empty(x.shape[0], codes.shape[0])
