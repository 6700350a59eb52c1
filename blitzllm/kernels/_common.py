"""What the kernel families share: the Triton import (optional), the dispatch rule of the
public ops (``use_triton``, and ``reference_ops`` to force the torch references), device facts,
the launchers' operand layout and config checks, and the programmatic-dependent-launch helpers."""
from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

from .. import envs

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


_REFERENCE = contextvars.ContextVar("blitz_reference_ops", default=False)


def use_triton(t: torch.Tensor) -> bool:
    """Dispatch rule of the public ops: Triton for CUDA tensors, torch otherwise, and torch
    everywhere inside ``reference_ops()``."""
    return HAS_TRITON and t.is_cuda and not _REFERENCE.get()


@contextlib.contextmanager
def reference_ops(on: bool = True):
    """Inside: every public op takes its torch reference, on any device (the engine's knob
    BLITZ_REFERENCE: the independent oracle of the GPU end-to-end tests). Scoped to the
    current thread / task."""
    token = _REFERENCE.set(bool(on))
    try:
        yield
    finally:
        _REFERENCE.reset(token)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where its last dim is contiguous, else a contiguous copy: the layout of the
    launchers' operands (their kernels take row strides, and unit steps along a row)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def checked_config(config, keys: tuple, what: str) -> dict:
    """A copy of the launch overrides ``config`` (None: none); KeyError on a key not in ``keys``."""
    config = dict(config or {})
    unknown = set(config) - set(keys)
    if unknown:
        raise KeyError(f"unknown {what} config keys {sorted(unknown)}; expected {keys}")
    return config


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    """Streaming multiprocessors of t's device (a nominal 8 off-GPU, e.g. the interpreter)."""
    if t.is_cuda:
        return num_sms(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return 8


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple:
    return torch.cuda.get_device_capability(device_index)


def capability(t: torch.Tensor) -> tuple:
    """(major, minor) compute capability of the CUDA device holding ``t``."""
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device launch with programmatic dependent launch (Hopper+): they
    may start while the kernel before finishes, then ``pdl_wait``. ``BLITZ_PDL=0`` turns it off."""
    if not use_triton(t) or not envs.get("BLITZ_PDL"):
        return False
    return capability(t)[0] >= 9


def pdl_launch_kwargs(enabled: bool) -> dict:
    """Extra launch options for ``pdl_enabled`` launches (the interpreter takes none)."""
    return {"launch_pdl": True} if enabled else {}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the previous kernel's writes are visible (no-op without PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Let the next PDL kernel launch once every program of this one got here: after the main
    loop, or at the start where the next kernel streams its weights before its own wait."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
