"""Copy a stream of HF-named checkpoint tensors into a model, packing shards as the model
declares (``packed_modules``); or fill it with dummy weights. One tensor in flight at a time.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import torch

from ..layers.linear import PackedLinear


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder}")
    for fname in files:
        with safe_open(str(folder / fname), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    disable = os.environ.get("BLITZ_NO_PROGRESS") == "1"
    return tqdm(total=total, desc=desc, unit="tensor", leave=False, disable=disable)


def load_weights(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                 total: int | None = None) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    packed = getattr(model, "packed_modules", {})
    # a model with weights that are not a plain copy or a packed shard (stacked MoE experts,
    # MTP layers) claims them first: load_custom_weight(name, tensor) -> the keys it loaded,
    # or None when the name is not its business
    custom = getattr(model, "load_custom_weight", None)
    loaded: set[str] = set()
    bar = _progress(total or 0, "loading weights")
    for name, tensor in tensors:
        if bar is not None:
            bar.update(1)
        if "rotary_emb.inv_freq" in name:
            continue
        if custom is not None:
            keys = custom(name, tensor)
            if keys is not None:
                loaded.update(keys)
                del tensor
                continue
        target, shard = name, None
        parts = name.split(".")
        for i, p in enumerate(parts):
            if p in packed:
                new, shard = packed[p]
                target = ".".join(parts[:i] + [new] + parts[i + 1:])
                break
        param = params.get(target)
        if param is None:
            if _is_unused_layer(name, model):
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        with torch.no_grad():
            if shard is None:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                                     f"model {tuple(param.shape)}")
                param.copy_(tensor)
                loaded.add(target)
            else:
                mod = modules[target.rsplit(".", 1)[0]]
                assert isinstance(mod, PackedLinear)
                param[mod.shard_slice(shard)].copy_(tensor)
                loaded.add(f"{target}#{shard}")
        del tensor
    if bar is not None:
        bar.close()
    _check_complete(model, params, modules, loaded)


def _is_unused_layer(name: str, model) -> bool:
    """Layers past a ``num_layers`` override are skipped, not errors."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2]) >= model.config.num_layers
    return False


def _check_complete(model, params, modules, loaded):
    missing = []
    tied = {id(p) for n, p in params.items() if n in loaded}
    required = getattr(model, "required_load_keys", None)  # pairs with load_custom_weight
    for n, p in params.items():
        mod = modules[n.rsplit(".", 1)[0]] if "." in n else model
        need = required(n) if required is not None else None
        if need is not None:
            if all(k in loaded for k in need):
                continue
        elif isinstance(mod, PackedLinear) and n.endswith(("weight", "bias")):
            need = [f"{n}#{i}" for i in range(len(mod.shard_sizes))]
            if all(k in loaded for k in need):
                continue
        elif n in loaded or id(p) in tied:
            continue
        missing.append(n)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:6])}"
                         + (" ..." if len(missing) > 6 else ""))


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights with sane scales (norms at 1), drawn in place on the model's device:
    for speed work, where the values do not change the time."""
    gens: dict = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
                continue
            gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            std = 0.02 if "embed" in name else fan_in ** -0.5
            if "bias" in name:
                std = 0.02
            p.normal_(0.0, std, generator=gen)


def export_hf_state_dict(model: torch.nn.Module) -> dict:
    """The inverse of ``load_weights``: HF checkpoint names -> tensors (views, no copies),
    packed parameters split back into their shards. Lets a peer run on our exact weights."""
    inverse = {}
    for ck, (packed, idx) in getattr(model, "packed_modules", {}).items():
        inverse.setdefault(packed, {})[idx] = ck
    modules = dict(model.named_modules())
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        mod_name, _, leaf = name.rpartition(".")
        mod = modules[mod_name]
        short = mod_name.rpartition(".")[2]
        if isinstance(mod, PackedLinear) and short in inverse:
            prefix = mod_name.rpartition(".")[0]
            for idx, ck in inverse[short].items():
                out[f"{prefix}.{ck}.{leaf}"] = p.data[mod.shard_slice(idx)]
        else:
            out[name] = p.data
    return out
