"""Small helpers shared by the kernel launchers."""
from __future__ import annotations

import functools

import torch

try:  # Triton is optional: without it every public op falls back to torch.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    import types

    def _jit(fn=None, **_kw):
        return fn if fn is not None else (lambda f: f)

    # Stand-ins so that kernel modules still import (their kernels never run).
    triton = types.SimpleNamespace(jit=_jit, cdiv=lambda a, b: -(-a // b))
    tl = types.SimpleNamespace(constexpr=object)
    HAS_TRITON = False


def use_triton(t: torch.Tensor) -> bool:
    """Dispatch rule of the public ops: Triton for CUDA tensors, torch otherwise."""
    return HAS_TRITON and t.is_cuda


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    """Streaming multiprocessors of t's device (a nominal 8 off-GPU, e.g. the interpreter)."""
    if t.is_cuda:
        return num_sms(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return 8
