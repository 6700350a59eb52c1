"""Quantized linear weights kept on their grid on the CPU (the default there): a GGUF file's raw
Q4_0 / Q4_1 / Q8_0 blocks read straight from the file (q/k rows un-permuted for Llama, as
``gguf_file`` does for the dequantized tensors), or a GPTQ / AWQ / compressed-tensors folder's
codes as such blocks (``loader/quantized.py`` ``quantized_grids``); the shards of a packed
projection stacked, and each ``Linear`` given the packed form of ``kernels/cpu_quant`` in place
of its float weight. A GGUF embedding table keeps its dequantized float values (only looked-up
rows are read); a tied lm_head gets its own packed copy of the table's blocks.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..kernels.cpu_quant import pack_q4, pack_q8_blocks
from ..layers.linear import Linear, PackedLinear
from .gguf_file import GRID_TYPES, _hf_name, _rope_heads, _unpermute, raw_blocks


def read_grids(reader, config: dict, names=None) -> dict:
    """HF name -> (kind, q, d, m) for every Q4_0 / Q4_1 / Q8_0 2-D tensor (``names``: only those)."""
    out = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None or t.tensor_type not in GRID_TYPES or len(t.shape) != 2 or t.shape[0] % 32:
            continue
        if names is not None and name not in names:
            continue
        kind, *arrays = raw_blocks(reader, t)
        heads = _rope_heads(name, config)
        arrays = [a if heads is None or a is None else _unpermute(a, heads) for a in arrays]
        out[name] = (kind, *(None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in arrays))
    return out


def _linear_names(model: nn.Module) -> dict:
    """Linear module -> its checkpoint tensor names, shard order (packed_modules inverted)."""
    inverse: dict = {}
    for ck, (packed, idx) in getattr(model, "packed_modules", {}).items():
        inverse.setdefault(packed, {})[idx] = ck
    cfg = getattr(model, "config", None)
    out = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, Linear) or mod.weight is None:
            continue
        prefix, _, short = name.rpartition(".")
        if isinstance(mod, PackedLinear) and short in inverse:
            out[mod] = [f"{prefix}.{inverse[short][i]}.weight" for i in range(len(mod.shard_sizes))]
        else:
            out[mod] = [f"{name}.weight"]
    lm_head = getattr(model, "lm_head", None)
    if cfg is not None and getattr(cfg, "tie_word_embeddings", False) and isinstance(lm_head, Linear):
        out[lm_head] = ["model.embed_tokens.weight"]
    return out


def apply_gguf_grids(model: nn.Module, reader, config: dict) -> set:
    """Every Linear whose checkpoint tensors are all Q4_0/Q4_1 (one kind for all shards) or all
    Q8_0 becomes packed (``Linear.quant``); others keep their float weights. Returns the
    checkpoint names no float parameter needs any more (the stream may skip them)."""
    targets = _linear_names(model)
    return apply_grids(model, targets, read_grids(reader, config, {n for names in targets.values() for n in names}))


def apply_checkpoint_grids(model: nn.Module, src):
    """A GPTQ / AWQ / compressed-tensors folder's linears whose codes the kernels take as they are
    become packed (as ``apply_gguf_grids``); returns the source whose weight stream leaves out
    their parts (the others are dequantized as they stream in)."""
    from dataclasses import replace
    from .quantized import quantized_grids, quantized_stream
    from .weights import iter_safetensors
    targets = _linear_names(model)
    modules = {n[:-len(".weight")] for names in targets.values() for n in names}
    found = quantized_grids(iter_safetensors(src.path, lazy=True), src.hf_config, modules)
    done = apply_grids(model, targets, {f"{m}.weight": g for m, g in found.items()})
    skip = {n[:-len(".weight")] for n in done}
    stream = quantized_stream(src.hf_config)
    return replace(src, tensors=lambda: stream(iter_safetensors(src.path), skip), slices=None)


def apply_grids(model: nn.Module, targets: dict, grids: dict) -> set:
    """``grids``: checkpoint weight name -> (kind, q, d, m); see ``apply_gguf_grids``."""
    done: set = set()
    for mod, names in targets.items():
        if mod.bias is not None and mod.bias.dtype != torch.float32:
            continue
        parts = [grids.get(n) for n in names]
        if any(p is None for p in parts) or len({(p[0], p[3] is None) for p in parts}) != 1:
            continue
        kind = parts[0][0]
        q = torch.cat([p[1] for p in parts])
        d = torch.cat([p[2] for p in parts])
        if tuple(q.shape) != (mod.out_features, mod.in_features) or mod.out_features % 16:
            continue  # (torch's int4 CPU packing takes N % 16 == 0)
        if kind == "q8":
            mod.quant = pack_q8_blocks(q, d)
        else:
            mod.quant = pack_q4(q, d, None if parts[0][3] is None else torch.cat([p[3] for p in parts]))
        mod.weight = None  # (the Linear computes through ``quant``; a tied lm_head unties)
        done.update(names)
    still = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {n for n in done if n not in still}  # (a tied table stays: the embedding reads it)
