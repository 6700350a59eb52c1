"""Copy a stream of HF-named checkpoint tensors into a model, one tensor in flight at a time, or
fill it with dummy weights; export the inverse. Owns applying the mappings a model declares
(``packed_modules``, ``hf_module_renames``, ``checkpoint_name``, ``load_custom_weight`` /
``required_load_keys``) and its tensor-parallel parts (``tp_parts``: only that part is read).
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Iterable, Iterator

import torch

from .. import envs
from ..layers.parallel import copy_part, module_part
from ..layers.linear import PackedLinear
from ..layers.moe import HF_FUSED_NAMES, FusedMoE, Router, hf_expert_tensors
from .fp8 import is_fp8


def iter_safetensors(folder: Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every checkpoint tensor; ``lazy``: (name, safetensors slice), read
    on indexing (``slice[a:b]``), so a tensor-parallel rank reads only its part."""
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
                yield key, (f.get_slice(key) if lazy else f.get_tensor(key))


def load_weights(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                 total: int | None = None) -> None:
    from tqdm import tqdm
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    packed = getattr(model, "packed_modules", {})
    # a model with weights that are not a plain copy or a packed shard (stacked MoE experts,
    # MTP layers) claims them first: load_custom_weight(name, tensor) -> the keys it loaded,
    # or None when the name is not its business
    custom = getattr(model, "load_custom_weight", None)
    renames = getattr(model, "hf_module_renames", {})
    # a model may map checkpoint names itself: checkpoint_name(name) -> our name, or None to skip
    # the tensor (the text model of a multimodal folder: its vision tower, its MTP layers)
    checkpoint_name = getattr(model, "checkpoint_name", None)
    loaded: set[str] = set()
    # (tensor-parallel workers set BLITZ_NO_PROGRESS: rank 0 shows the bar)
    bar = tqdm(total=total or 0, desc="loading weights", unit="tensor", leave=False,
               disable=bool(envs.get("BLITZ_NO_PROGRESS")))
    for name, tensor in tensors:
        bar.update(1)
        if "rotary_emb.inv_freq" in name:
            continue
        if checkpoint_name is not None:
            name = checkpoint_name(name)
            if name is None:
                continue
        if renames:
            name = _rename_parts(name, renames)
        if is_fp8(tensor):  # (an FP8 quantization_config dequantizes them before here)
            raise ValueError(f"checkpoint tensor {name!r} is float8 but config.json has no FP8 "
                             "quantization_config (quant_method 'fp8', weight_block_size) to scale it")
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
        mod_name, _, leaf = target.rpartition(".")
        mod = modules[mod_name]
        if shard is None:
            copy_part(param, tensor, module_part(mod, leaf, None), name)
            loaded.add(target)
        else:
            assert isinstance(mod, PackedLinear)
            copy_part(param[mod.shard_slice(shard)], tensor, module_part(mod, leaf, shard), name)
            loaded.add(f"{target}#{shard}")
        del tensor
    bar.close()
    _check_complete(model, params, modules, loaded)


def _rename_parts(name: str, renames: dict) -> str:
    """Replace whole dotted components of ``name`` per ``renames``."""
    return ".".join(renames.get(p, p) for p in name.split("."))


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
        if need is None and isinstance(mod, PackedLinear) and n.endswith(("weight", "bias")):
            need = [f"{n}#{i}" for i in range(len(mod.shard_sizes))]
        if not (all(k in loaded for k in need) if need is not None else n in loaded or id(p) in tied):
            missing.append(n)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:6])}"
                         + (" ..." if len(missing) > 6 else ""))


def init_dummy_weights(model: torch.nn.Module, seed: int = 0, per_parameter_seeds: bool = False) -> None:
    """Random weights with sane scales drawn in place, for speed work; MoE models route in balance
    (docs/models.md). ``per_parameter_seeds`` (tensor-parallel ranks): a seed per parameter name,
    so parameters every rank holds whole agree."""
    gens: dict = {}
    routers = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Router)}
    routers |= {n for n, _ in model.named_parameters() if n.endswith("mlp.gate.weight")}
    lm_head = getattr(model, "lm_head", None)
    tied = lm_head is not None and any(lm_head.weight is p for n, p in model.named_parameters() if "embed" in n)
    layers = getattr(getattr(model, "config", None), "num_layers", 1)
    embed_std = 2.0 * layers ** 0.5 if routers and not tied else 0.02
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
                continue
            if name.endswith("e_score_correction_bias"):
                p.zero_()
                continue
            if per_parameter_seeds:
                gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            else:
                gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
            if name in routers:
                p.copy_(_balanced_router(p.shape[0], p.shape[1], gen, p.device))
                continue
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            std = embed_std if "embed" in name else fan_in ** -0.5
            if "bias" in name:
                std = 0.02
            p.normal_(0.0, std, generator=gen)


def _balanced_router(experts: int, hidden: int, gen, device) -> torch.Tensor:
    """[E, H] rows of unit norm (orthonormal when E <= H): logits of a unit-RMS input have
    std 1 for every expert."""
    g = torch.randn(max(experts, hidden), min(experts, hidden), generator=gen, device=device)
    if experts <= hidden:
        q, _ = torch.linalg.qr(g)          # [H, E], orthonormal columns
        return q.t().contiguous()
    return g / g.norm(dim=1, keepdim=True)  # [E, H], E > H: unit rows


def export_hf_state_dict(model: torch.nn.Module, per_expert: bool = False) -> dict:
    """The inverse of ``load_weights`` (views, packed shards split back), so a peer runs on our
    exact weights: transformers' module names (fused ``experts.gate_up_proj`` / ``down_proj``),
    or with ``per_expert`` the checkpoint-file names (per-expert tensors, our module names)."""
    inverse = {}
    for ck, (packed, idx) in getattr(model, "packed_modules", {}).items():
        inverse.setdefault(packed, {})[idx] = ck
    renames = {} if per_expert else {ours: theirs for theirs, ours in getattr(model, "hf_module_renames", {}).items()}
    modules = dict(model.named_modules())
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        mod_name, _, leaf = name.rpartition(".")
        mod = modules[mod_name]
        prefix, _, short = mod_name.rpartition(".")
        if isinstance(mod, PackedLinear) and short in inverse:
            for idx, ck in inverse[short].items():
                out[f"{prefix}.{ck}.{leaf}"] = p.data[mod.shard_slice(idx)]
        elif isinstance(mod, FusedMoE) and leaf in HF_FUSED_NAMES:
            out.update(hf_expert_tensors(mod_name, mod, leaf, p.data, per_expert))
        else:
            out[name] = p.data
    if renames:
        out = {_rename_parts(k, renames): v for k, v in out.items()}
    return out
