"""FP8 block-quantized checkpoints (``quant_method: "fp8"``, ``weight_block_size``): pairs each
float8 ``<x>.weight`` with its ``<x>.weight_scale_inv`` in the weight stream and hands on the
fp32 product as a plain tensor, so nothing downstream sees float8 (docs/models.md).
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch

from ..kernels.fp8_weights import dequantize_fp8_block

SCALE_SUFFIX = "_scale_inv"
INT_METHODS = ("compressed-tensors", "gptq", "awq")   # the other quant_methods read, by loader/quantized.py
_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                "float8_e5m2fnuz") if hasattr(torch, n))


def fp8_block_size(hf_config: dict) -> Optional[tuple[int, int]]:
    """The checkpoint's FP8 weight block ([rows, cols]), or None when it is not quantized;
    ValueError for a quantization this loader does not read."""
    t = hf_config.get("text_config") or {}
    q = hf_config.get("quantization_config") or t.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method in INT_METHODS:   # (loader/quantized.py reads them)
        return None
    if method != "fp8":
        raise ValueError(f"quantization_config quant_method {method!r} is not supported "
                         f"(fp8 block-quantized, {', '.join(INT_METHODS)} are)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"FP8 checkpoints with activation_scheme {q.get('activation_scheme')!r} are not "
                         "supported (only 'dynamic': no stored activation scales)")
    block = q.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"FP8 checkpoints need weight_block_size as two positive integers, got {block!r} "
                         "(per-tensor FP8 scales are not supported)")
    if q.get("scale_fmt") not in (None, "ue8m0"):
        raise ValueError(f"FP8 checkpoints with scale_fmt {q.get('scale_fmt')!r} are not supported (none or 'ue8m0')")
    return int(block[0]), int(block[1])


def fp8_pow2_scales(hf_config: dict) -> bool:
    """Whether the checkpoint's block scales are powers of two (``scale_fmt: ue8m0``, as
    DeepSeek-V3.1 and later: scale = 2 ** ceil(log2(amax / 448)))."""
    t = hf_config.get("text_config") or {}
    q = hf_config.get("quantization_config") or t.get("quantization_config") or {}
    return q.get("scale_fmt") == "ue8m0"


def is_fp8(t) -> bool:
    dtype = t.dtype if isinstance(t, torch.Tensor) else _slice_dtype(t)
    return dtype in _FP8_DTYPES


def _slice_dtype(s) -> Optional[torch.dtype]:
    """A lazy safetensors slice's dtype ("F8_E4M3" and the like), as torch's."""
    name = getattr(s, "get_dtype", lambda: None)()
    return {"F8_E4M3": getattr(torch, "float8_e4m3fn", None),
            "F8_E5M2": getattr(torch, "float8_e5m2", None)}.get(name)


def _full(t) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t[:]


def dequantize_stream(tensors: Iterable, block: tuple[int, int]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with each float8 ``<x>.weight`` + ``<x>.weight_scale_inv`` pair
    replaced by the fp32 ``<x>.weight`` (either waits only for its partner); others unchanged."""
    weights: dict = {}
    scales: dict = {}
    for name, t in tensors:
        if name.endswith(SCALE_SUFFIX):
            base = name[:-len(SCALE_SUFFIX)]
            if base in weights:
                yield base, dequantize_fp8_block(weights.pop(base), _full(t), block, base)
            else:
                scales[base] = _full(t)
        elif is_fp8(t):
            if name in scales:
                yield name, dequantize_fp8_block(_full(t), scales.pop(name), block, name)
            else:
                weights[name] = _full(t)
        else:
            yield name, t
    if weights:
        first = next(iter(weights))
        raise ValueError(f"FP8 checkpoint tensor {first!r} has no {first + SCALE_SUFFIX!r} beside it"
                         + (f" (and {len(weights) - 1} more)" if len(weights) > 1 else ""))
    if scales:
        raise ValueError(f"checkpoint tensor {next(iter(scales)) + SCALE_SUFFIX!r} scales no FP8 weight")
