"""How values enter the paged KV cache, whatever its dtype: the model's, or fp8 (e4m3) with
``kv_cache_dtype="fp8"``. An fp8 entry is the value clamped to e4m3's finite range (+-448) and
rounded once; no scale is applied (a scale of 1.0, vLLM's default where a checkpoint brings no
calibrated k/v scales). Every writer rounds a value to the model's dtype first, then to the
cache's (so the fused Triton writes and the torch paths store the same bytes); readers widen the
entries to their compute dtype as they load them.

``to_cache`` is the torch form, ``store_cast`` the Triton kernels' (the same clamp, so that the
compiled kernels, the interpreter and the torch paths store the same bytes), ``copy_rows`` an
``index_copy_`` that also takes fp8 caches (which the CPU's index_copy_ lacks).
"""
from __future__ import annotations

import torch

from .._common import tl, triton

# kv_cache_dtype -> the cache's torch dtype ("auto": the model's dtype)
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
_FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for ``kv_cache_dtype`` ``name`` (auto | fp8 | fp8_e4m3)."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    return KV_CACHE_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as cache entries of ``dtype``: an fp8 cache's clamped to +-448 first, so that overflow
    saturates by this rule rather than by each cast's own (torch's casts and the GPU's
    cvt.satfinite saturate; the Triton interpreter's cast does not)."""
    if is_fp8(dtype) and x.dtype != dtype:
        return x.clamp(-_FP8_MAX, _FP8_MAX).to(dtype)
    return x.to(dtype)


def copy_rows(cache: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache.index_copy_(0, index, rows)`` with ``rows`` cast by ``to_cache``; fp8 caches
    copy their bytes (one-byte rows as uint8: the CPU has no fp8 index_copy_)."""
    rows = to_cache(rows, cache.dtype)
    if is_fp8(cache.dtype):
        cache.view(torch.uint8).index_copy_(0, index, rows.view(torch.uint8))
    else:
        cache.index_copy_(0, index, rows)


@triton.jit
def store_cast(x, ptr):
    """``x`` as entries of the cache that ``ptr`` points into: clamped to +-448 for an fp8 (e4m3)
    cache, as ``to_cache``."""
    if ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.clamp(x, -448.0, 448.0)
    return x.to(ptr.dtype.element_ty)
