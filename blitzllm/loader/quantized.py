"""Integer- and FP8-quantized checkpoints besides DeepSeek's block FP8 (``loader/fp8.py``):
compressed-tensors (``quant_method: "compressed-tensors"``, llm-compressor's format:
``pack-quantized`` int4 / int8, ``naive-quantized`` int8, ``float-quantized`` FP8), GPTQ and AWQ
(GEMM). Their weights are dequantized as they stream in (``kernels/weight_codes.py``), so the
model sees plain float tensors; what runs is the dequantized weights in the engine's dtype
(``--weight-dtype`` can quantize them again), with the activations unquantized where a
scheme quantizes them too (W8A8: the weights as stored, the activations in full precision).

A module's parts (``weight_packed`` / ``weight_scale`` / ..., or ``qweight`` / ``qzeros`` /
``scales`` / ``g_idx``) are held until its last one arrives; the scales of activations and of
an FP8 KV cache (``input_scale``, ``k_scale``, ...) are dropped (docs/models.md).
"""
from __future__ import annotations

import re
from typing import Callable, Iterable, Iterator, Optional

import torch

from ..kernels.weight_codes import AWQ_SLOT, dequantize_grouped, q4_blocks, q8_blocks, unpack_int32

CT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized", "dense")
# tensors of activation quantization and of a quantized KV cache: not read (see above)
_DROPPED = ("input_scale", "input_zero_point", "input_global_scale", "output_scale", "output_zero_point",
            "k_scale", "v_scale", "q_scale", "kv_scale", "weight_global_scale")
_INT_DTYPES = (torch.int8, torch.uint8)


def _qconfig(hf_config: dict) -> dict:
    t = hf_config.get("text_config") or {}
    return hf_config.get("quantization_config") or t.get("quantization_config") or {}


def _codec(hf_config: dict) -> Optional["_Collector"]:
    q = _qconfig(hf_config)
    method = q.get("quant_method")
    kinds = {"compressed-tensors": _CompressedTensors, "gptq": _Gptq, "awq": _Awq}
    return kinds[method](q) if method in kinds else None


def quantized_stream(hf_config: dict) -> Optional[Callable[[Iterable], Iterator]]:
    """The weight-stream filter of the checkpoint's quantization (compressed-tensors, GPTQ, AWQ),
    or None when it has none of them; a ValueError names what it cannot read."""
    codec = _codec(hf_config)
    return None if codec is None else codec.stream


def quantized_grids(tensors: Iterable, hf_config: dict, modules: set) -> dict:
    """module -> ("q4", q, d, m) / ("q8", q, d, None): the codes of those of ``modules`` that the
    CPU's GGUF kernels take as they are (4-bit codes in groups of 32 or more consecutive columns;
    symmetric 8-bit ones), read from ``tensors`` (the checkpoint's, lazy slices)."""
    codec, held, out = _codec(hf_config), {}, {}
    for name, t in tensors:
        module, _, part = name.rpartition(".")
        if module in modules and codec.claims(module, part, t):
            parts = codec.collect(held, module, part, t)
            grid = None if parts is None else codec.grid(module, parts)
            if grid is not None:
                out[module] = grid
    return out


def check_quantization(hf_config: dict, asked: Optional[str]) -> None:
    """vLLM's ``quantization`` for a checkpoint method (awq, gptq, compressed-tensors; their
    ``_marlin`` kernels' names too): a ValueError when the checkpoint's quant_method is another."""
    if asked in (None, "fp8"):   # (fp8: quantize the weights here, engine/args.py)
        return
    have = _qconfig(hf_config).get("quant_method")
    if have != asked.removesuffix("_marlin"):
        raise ValueError(f"quantization {asked!r} asked, but the checkpoint's quantization_config has quant_method "
                         f"{have!r} (a quantized checkpoint's method is read from it: leave quantization out)")


def _bits(q: dict, key: str = "bits") -> int:
    bits = q.get(key, 4)
    if bits not in (2, 4, 8):
        raise ValueError(f"{q.get('quant_method')} checkpoints of {bits}-bit weights are not supported (2, 4, 8)")
    return bits


class _Collector:
    """Holds each module's parts (``<module>.<part>``) until those ``required`` names are all
    there, then yields ``<module>.weight`` = ``decode(parts)``; other tensors pass as they come.
    An optional part (a g_idx) is used when it came first: checkpoints list a module's tensors
    in name order, where it does; one that comes after the weight was built is a ValueError."""
    parts: tuple = ()            # the suffixes that belong to a quantized module

    def required(self, module: str, have: dict) -> tuple:
        raise NotImplementedError

    def decode(self, module: str, parts: dict) -> torch.Tensor:
        raise NotImplementedError

    def grid(self, module: str, parts: dict) -> Optional[tuple]:
        """The module's codes as GGUF blocks (``quantized_grids``), or None."""
        return None

    def claims(self, module: str, part: str, t) -> bool:
        return part in self.parts

    def collect(self, held: dict, module: str, part: str, t) -> Optional[dict]:
        """Adds a claimed part to ``held``; the module's parts once they are all there, else None."""
        have = held.setdefault(module, {})
        have[part] = t if isinstance(t, torch.Tensor) else t[:]
        return held.pop(module) if all(p in have for p in self.required(module, have)) else None

    def stream(self, tensors: Iterable, skip: set = frozenset()) -> Iterator:
        """``skip``: modules whose parts are dropped (their codes kept by ``quantized_grids``)."""
        held: dict = {}
        done: set = set()
        for name, t in tensors:
            module, _, part = name.rpartition(".")
            if part in _DROPPED or module in skip and self.claims(module, part, t):
                continue
            if not self.claims(module, part, t):
                yield name, t
                continue
            if module in done:
                raise ValueError(f"checkpoint tensor {name!r} comes after its module's weight was built "
                                 f"from the parts before it")
            parts = self.collect(held, module, part, t)
            if parts is not None:
                yield module + ".weight", self.decode(module, parts)
                done.add(module)
        if held:
            module, have = next(iter(held.items()))
            missing = [p for p in self.required(module, have) if p not in have]
            raise ValueError(f"quantized module {module!r} has no {', '.join(missing)} in the checkpoint"
                             + (f" (and {len(held) - 1} more modules)" if len(held) > 1 else ""))


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' targets and ignore entries: ``re:<pattern>``, a module class (taken to
    mean every linear layer) or a module name (or its end)."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    if target[:1].isupper():
        return True
    return name == target or name.endswith("." + target)


class _CompressedTensors(_Collector):
    parts = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")

    def __init__(self, q: dict):
        fmt = q.get("format")
        groups = q.get("config_groups") or {}
        if q.get("sparsity_config") or q.get("transform_config"):
            raise ValueError("compressed-tensors checkpoints with sparsity or transforms are not supported")
        for f in [fmt] + [g.get("format") or fmt for g in groups.values()]:
            if f not in CT_FORMATS + (None,):
                raise ValueError(f"compressed-tensors format {f!r} is not supported ({', '.join(CT_FORMATS)} are)")
        for g in groups.values():
            w = g.get("weights") or {}
            if w and (w.get("type") not in ("int", "float") or w.get("strategy") not in (
                    "tensor", "channel", "group", "block")):
                raise ValueError(f"compressed-tensors weights of type {w.get('type')!r} and strategy "
                                 f"{w.get('strategy')!r} are not supported (int or float; tensor, channel, group, block)")
        self.groups = [g for g in groups.values() if g.get("weights")]
        self.ignore = q.get("ignore") or []

    def _scheme(self, module: str) -> dict:
        if any(_matches(module, t) for t in self.ignore if not t[:1].isupper()):
            return {}
        for g in self.groups:
            if any(_matches(module, t) for t in g.get("targets") or ()):
                return g["weights"]
        return {}

    def claims(self, module: str, part: str, t) -> bool:
        if part in self.parts:
            return True
        # naive / float-quantized: the codes are "weight" itself (int8 or float8)
        return part == "weight" and (getattr(t, "dtype", None) in _INT_DTYPES + _fp8_dtypes() or _slice_quantized(t))

    def required(self, module: str, have: dict) -> tuple:
        w = self._scheme(module)
        codes = "weight_packed" if "weight_packed" in have or "weight" not in have else "weight"
        need = (codes, "weight_scale") + (("weight_shape",) if codes == "weight_packed" else ())
        if w and not w.get("symmetric", True) and w.get("type") == "int":
            need += ("weight_zero_point",)
        return need

    @staticmethod
    def _codes(p: dict) -> tuple:
        """(codes [out, in] as values: signed ints or float8, zero points or None, bits): a packed
        weight unpacked (its codes and zero points stored plus 2 ** (bits - 1)), else as stored."""
        zero = p.get("weight_zero_point")
        if "weight_packed" not in p:
            return p["weight"], zero, 8
        out, cols = (int(v) for v in p["weight_shape"].tolist())
        bits = p["weight_packed"].shape[1] * 32 // cols
        q = unpack_int32(p["weight_packed"], bits, 1)[:, :cols] - (1 << (bits - 1))
        return q, None if zero is None else unpack_int32(zero, bits, 0)[:out] - (1 << (bits - 1)), bits

    def decode(self, module: str, p: dict) -> torch.Tensor:
        scale, g_idx, w = p["weight_scale"], p.get("weight_g_idx"), self._scheme(module)
        q, zero, _ = self._codes(p)
        out, cols = q.shape
        if w.get("strategy") == "block":
            bh, bw = w.get("block_structure") or (128, 128)
            scale = scale.repeat_interleave(bh, 0)[:out].repeat_interleave(bw, 1)[:, :cols]
            zero = None if zero is None else zero.repeat_interleave(bh, 0)[:out].repeat_interleave(bw, 1)[:, :cols]
        return dequantize_grouped(q, scale, zero, g_idx)

    def grid(self, module: str, p: dict) -> Optional[tuple]:
        """int4 (any zero points) and symmetric int8 codes in groups or channels, without g_idx."""
        w = self._scheme(module)
        if w.get("type") != "int" or w.get("strategy") not in ("group", "channel") or "weight_g_idx" in p:
            return None
        q, zero, bits = self._codes(p)
        scale = p["weight_scale"].reshape(q.shape[0], -1)
        if bits == 4:   # (Q4_1 takes unsigned codes: q + 8, its zero 8 + the zero point)
            offset = 8 if zero is None else 8 + zero.reshape(q.shape[0], -1)
            blocks = q4_blocks(q.to(torch.int32) + 8, scale, torch.as_tensor(offset).expand_as(scale))
            return None if blocks is None else ("q4", *blocks)
        if bits == 8 and zero is None:
            blocks = q8_blocks(q, scale)
            return None if blocks is None else ("q8", *blocks, None)
        return None


class _Gptq(_Collector):
    """AutoGPTQ / GPTQModel checkpoints (``checkpoint_format`` gptq: zeros stored minus one;
    gptq_v2: as they are)."""
    parts = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, q: dict):
        self.bits = _bits(q)
        fmt = q.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        self.zero_offset = 1 if fmt == "gptq" else 0

    def required(self, module: str, have: dict) -> tuple:
        return "qweight", "qzeros", "scales"

    def _codes(self, p: dict) -> tuple:
        q = unpack_int32(p["qweight"], self.bits, 0).T                      # [out, in]
        zero = (unpack_int32(p["qzeros"], self.bits, 1) + self.zero_offset).T    # [out, groups]
        return q, p["scales"].T, zero[:q.shape[0]]

    def decode(self, module: str, p: dict) -> torch.Tensor:
        return dequantize_grouped(*self._codes(p), p.get("g_idx"))

    def grid(self, module: str, p: dict) -> Optional[tuple]:
        """4-bit codes whose groups run in column order (no activation order)."""
        q, scale, zero = self._codes(p)
        g = p.get("g_idx")
        if self.bits != 4 or g is not None and not torch.equal(
                g.long(), torch.arange(q.shape[1]) // (q.shape[1] // scale.shape[1])):
            return None
        blocks = q4_blocks(q, scale, zero)
        return None if blocks is None else ("q4", *blocks)


class _Awq(_Collector):
    """AutoAWQ's GEMM checkpoints (``version: gemm``, zero points)."""
    parts = ("qweight", "qzeros", "scales")

    def __init__(self, q: dict):
        self.bits = _bits(q, "bits" if "bits" in q else "w_bit")
        if self.bits != 4 or str(q.get("version", "gemm")).lower() != "gemm" or not q.get("zero_point", True):
            raise ValueError("AWQ checkpoints are read in AutoAWQ's GEMM layout, 4-bit with zero points; got "
                             f"bits {self.bits}, version {q.get('version')!r}, zero_point {q.get('zero_point')!r}")

    def required(self, module: str, have: dict) -> tuple:
        return "qweight", "qzeros", "scales"

    def _codes(self, p: dict) -> tuple:
        return unpack_int32(p["qweight"], 4, 1, AWQ_SLOT).T, p["scales"].T, unpack_int32(p["qzeros"], 4, 1, AWQ_SLOT).T

    def decode(self, module: str, p: dict) -> torch.Tensor:
        q, scale, zero = self._codes(p)
        return dequantize_grouped(q, scale, zero)

    def grid(self, module: str, p: dict) -> Optional[tuple]:
        blocks = q4_blocks(*self._codes(p))
        return None if blocks is None else ("q4", *blocks)


def _fp8_dtypes() -> tuple:
    return tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def _slice_quantized(t) -> bool:
    """A lazy safetensors slice of int8 or float8 codes."""
    return getattr(t, "get_dtype", lambda: None)() in ("I8", "U8", "F8_E4M3", "F8_E5M2")
