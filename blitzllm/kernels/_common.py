"""Small helpers shared by the kernel launchers."""
from __future__ import annotations

import functools
import os

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


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple:
    return torch.cuda.get_device_capability(device_index)


def capability(t: torch.Tensor) -> tuple:
    """(major, minor) compute capability of the CUDA device holding ``t``."""
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_enabled(t: torch.Tensor) -> bool:
    """Programmatic dependent launch (Hopper+): a kernel launched with it may start while
    the kernel before it finishes; it does its independent work (index math, weight loads)
    and then waits (``pdl_wait``) for the previous kernel's writes. ``BLITZ_PDL=0`` turns it
    off."""
    if not (HAS_TRITON and t.is_cuda) or os.environ.get("BLITZ_PDL", "1") == "0":
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
    """Let the next PDL kernel launch once every program of this one got here. Kernels call it
    after their main loop (or, where the next kernel streams its weights before its own wait,
    at their start): triggering right after the wait instead let the waiting dependents take
    SM slots from the running kernel and measured slower."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


# -- L2 prefetch of the next kernels' weights ------------------------------------------------
# Decode at small batch alternates bandwidth-bound GEMVs with latency-bound kernels during
# which HBM idles. A latency-bound kernel can ask the L2 to fetch the next kernels' weights
# meanwhile (Hopper's bulk prefetch: one instruction per range, no registers, the issuing
# thread does not wait), so those kernels then read L2 (``kernels/moe.py``).
L2_PREFETCH_LANES = 128  # one range per thread of a 4-warp program


def l2_prefetch_supported(t: torch.Tensor) -> bool:
    """cp.async.bulk.prefetch.L2 exists from sm_90 on (not in the interpreter)."""
    if not (HAS_TRITON and t.is_cuda) or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return capability(t)[0] >= 9


def l2_prefetchable(t: torch.Tensor, stride_bytes: int) -> bool:
    """Blocks of ``t`` that start ``stride_bytes`` apart can be bulk-prefetched (sm_90+, 16-byte
    aligned): the GEMV's weight rows, an MoE weight stack's experts."""
    return l2_prefetch_supported(t) and t.data_ptr() % 16 == 0 and stride_bytes % 16 == 0


def l2_prefetch_chunk(nbytes: int, programs: int, lanes: int = L2_PREFETCH_LANES) -> int:
    """Bytes per prefetch instruction: the ranges of all programs' lanes cover ``nbytes``
    in about one round (a multiple of 16, at least 256)."""
    per = -(-max(1, nbytes) // max(1, programs * lanes))
    return max(256, -(-per // 16) * 16)


@triton.jit
def _bulk_prefetch(addr, size):
    """cp.async.bulk.prefetch.L2 of ``size`` bytes at each address where size > 0; returns 0s
    that the caller must use (a store that never happens), or the compiler drops the asm."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _bulk_prefetch_last(addr, size):
    """``_bulk_prefetch`` with the lines marked evict-last in the L2 (the last candidates for
    replacement: a stream of normal lines passing through after them leaves them in)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b64 pol; setp.gt.s32 p, $2, 0; "
        "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
        "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def l2_prefetch(ptr, nbytes, chunk, pid, nprog, LANES: tl.constexpr, LAST: tl.constexpr = False,
                EVERY: tl.constexpr = 1):
    """Ask the L2 to fetch bytes [0, nbytes) of ``ptr`` (16-byte aligned, nbytes a multiple
    of 16): program ``pid`` of ``nprog`` (both computed in the kernel) takes ranges
    pid * LANES / EVERY ... of ``chunk`` bytes, one per EVERY-th of its LANES lanes. LANES should
    be the program's threads (a shorter tensor is held by several threads, each of which would
    issue the same prefetch); EVERY > 1 gives a program fewer, larger ranges. LAST: the lines
    come in marked evict-last."""
    base = ptr.to(tl.pointer_type(tl.int8))
    lanes = tl.arange(0, LANES).to(tl.int64)
    RANGES: tl.constexpr = LANES // EVERY
    first = pid.to(tl.int64) * RANGES * chunk
    step = nprog.to(tl.int64) * RANGES * chunk
    end = first * 0 + nbytes  # int64 (nbytes may arrive as a plain int)
    issued = tl.zeros([LANES], dtype=tl.int32)
    for c0 in range(first, end, step):
        off = c0 + (lanes // EVERY) * chunk
        size = tl.minimum(end - off, chunk)
        if EVERY > 1:
            size = tl.where(lanes % EVERY == 0, size, 0)
        size = size.to(tl.int32)
        if LAST:
            issued += _bulk_prefetch_last(base + off, size)
        else:
            issued += _bulk_prefetch(base + off, size)
    # the asm's result (always 0) feeds a store that never happens: without a use the
    # compiler dropped the asm (seen with Triton 3.6)
    tl.store(base + lanes, issued.to(tl.int8), mask=issued != 0)
