"""Reading a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)
into host tensors for the modules the manager wrapped, checked against the model: what cannot
be served exactly (DoRA, trained biases, modules_to_save, per-module rank patterns, a rank over
``max_lora_rank``, a target the model has no LoRA slot for) is a ValueError naming it, as vLLM
refuses them, rather than a silently different model.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from ..layers.parallel import Part
from .request import LoRARequest

# a PEFT target module -> (our module's name, slice of it); the fused q/k/v and gate/up take
# a LoRA per slice
TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
           "down_proj": ("down_proj", 0)}

_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<prefix>.+)\.(?P<target>\w+)\.lora_(?P<ab>[AB])(?:\.\w+)?\.weight$")


@dataclass
class LoRAAdapter:
    """One adapter read from disk: per wrapped module path, per slice (A [r, in], scale * B
    [out, r]) or None, in the model's activation dtype on the host."""
    name: str
    int_id: int
    path: str
    rank: int
    scale: float
    weights: dict = field(default_factory=dict)

    @property
    def key(self) -> tuple:
        """What the slot pool and the prefix cache tell adapters apart by."""
        return ("lora", self.int_id, self.path)


def slice_parts(mod) -> tuple:
    """(the part of A, [the part of each slice's B]) that this rank's ``mod`` holds of an adapter,
    None for all of it: under tensor parallelism a column-parallel linear (q/k/v, gate/up) holds
    its output rows of B and all of A, a row-parallel one (o, down) its input columns of A and all
    of B, so the LoRA rows it adds are this rank's share of the sum the all-reduce makes."""
    parts = getattr(mod, "tp_parts", None) or {}
    packed = hasattr(mod, "shard_sizes")
    row = parts.get(("weight", None))
    b_parts = []
    for i in range(len(mod.shard_sizes) if packed else 1):
        p = parts.get(("weight", i if packed else None))
        b_parts.append(p if p is not None and p.dim == 0 else None)
    return (row if row is not None and row.dim == 1 else None), b_parts


def full_shape(mod) -> tuple:
    """(in_features, [each slice's out_features]) of the whole model's ``mod``: its own sizes, or
    the checkpoint's that its tensor-parallel parts declare."""
    a_part, b_parts = slice_parts(mod)
    sizes = getattr(mod, "shard_sizes", [mod.out_features])
    return (a_part.full if a_part else mod.in_features), [p.full if p else s for p, s in zip(b_parts, sizes)]


def b_columns(part: Part) -> Part:
    """A slice's B part (rows of B [out, r]) as columns of the B^T the slots hold."""
    return Part(1, part.start, part.size, part.full)


def _config(path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is not a local folder")
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"LoRA adapter {path!r} has no adapter_config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is unreadable ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is not a JSON object")
    return cfg


def check_config(cfg: dict, path: str, max_rank: int) -> tuple:
    """(rank, scale, target names) of a PEFT config, or a ValueError for what we cannot serve."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"LoRA adapter {path!r}: r must be an integer >= 1, got {r!r}")
    if r > max_rank:
        raise ValueError(f"LoRA adapter {path!r}: rank {r} is larger than max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"LoRA adapter {path!r}: lora_alpha must be a number, got {alpha!r}")
    if cfg.get("use_dora"):
        raise ValueError(f"LoRA adapter {path!r}: DoRA (use_dora) is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: trained biases (bias={cfg['bias']!r}) are not supported")
    if cfg.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {path!r}: modules_to_save {cfg['modules_to_save']!r} is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {path!r}: {key} is not supported (one rank and alpha for all modules)")
    if cfg.get("layers_to_transform") is not None:
        raise ValueError(f"LoRA adapter {path!r}: layers_to_transform is not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        if targets not in TARGETS:  # (PEFT reads a string as a regex over module names)
            raise ValueError(f"LoRA adapter {path!r}: target_modules {targets!r} is a pattern or an unsupported "
                             f"module; supported: {', '.join(TARGETS)}")
        targets = [targets]
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"LoRA adapter {path!r}: target_modules must be a list of module names")
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise ValueError(f"LoRA adapter {path!r}: target module(s) {', '.join(map(str, bad))} not supported; "
                         f"supported: {', '.join(TARGETS)}")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, scale, set(targets)


def load_adapter(req: LoRARequest, modules: dict, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read ``req``'s folder for the wrapped ``modules`` ({path: PackedLinear or Linear}, paths as
    ``model.layers.0.self_attn.qkv_proj``): the whole adapter, whatever part of it a rank holds."""
    path = req.lora_path
    r, scale, targets = check_config(_config(path), path, max_rank)
    st = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(st):
        hint = " (adapter_model.bin is not read: save it as safetensors)" \
            if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
        raise ValueError(f"LoRA adapter {path!r} has no adapter_model.safetensors{hint}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        tensors = load_file(st)
    except (OSError, SafetensorError) as e:
        raise ValueError(f"LoRA adapter {path!r}: adapter_model.safetensors is unreadable ({e})") from None
    pairs: dict = {}
    for name, t in tensors.items():
        m = _NAME.match(name)
        if m is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name!r} is not a LoRA A/B weight "
                             "(embeddings, DoRA magnitudes, biases and saved modules are not supported)")
        target = m["target"]
        if target not in targets:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name!r} targets {target!r}, "
                             "which target_modules does not list")
        ours, index = TARGETS[target]
        mod_path = f"{m['prefix']}.{ours}"
        if mod_path not in modules:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name!r} targets {m['prefix']}.{target}, "
                             "which this model does not have")
        pairs.setdefault((mod_path, index), {})[m["ab"]] = t
    if not pairs:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA weights")
    out = LoRAAdapter(req.lora_name, req.lora_int_id, path, r, scale)
    for (mod_path, index), ab in pairs.items():
        in_f, shard = full_shape(modules[mod_path])
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: {mod_path} slice {index} lacks lora_{'AB'[('A' in ab)]}")
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (r, in_f) or tuple(b.shape) != (shard[index], r):
            raise ValueError(f"LoRA adapter {path!r}: {mod_path} slice {index} has lora_A {tuple(a.shape)} and "
                             f"lora_B {tuple(b.shape)}; the model needs ({r}, {in_f}) and "
                             f"({shard[index]}, {r})")
        slices = out.weights.setdefault(mod_path, [None] * len(shard))
        # (scale folded into B in float32, once, before the cast)
        slices[index] = (a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous())
    return out


def write_random_adapter(modules: dict, folder: str, rank: int, seed: int = 0, std: float = 0.02) -> None:
    """A random rank-``rank`` PEFT adapter on every projection of the manager's wrapped
    ``modules`` (path -> Linear), written into ``folder`` (``blitz bench latency --lora-rank``)."""
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, mod in modules.items():
        prefix, ours = path.rsplit(".", 1)
        in_f, sizes = full_shape(mod)
        for target, (name, i) in TARGETS.items():
            if name == ours:
                base = f"base_model.model.{prefix}.{target}"
                tensors[f"{base}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * std
                tensors[f"{base}.lora_B.weight"] = torch.randn(sizes[i], rank, generator=g) * std
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": sorted(TARGETS),
                   "bias": "none"}, f)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
