"""Random PEFT LoRA adapters for the tiny checkpoints (adapter_config.json + safetensors written
here, no peft needed) and the oracle: transformers on the checkpoint with the LoRA merged into
its weights, W + scale * B @ A."""
from __future__ import annotations

import json
import math
import os

import torch

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTN + ["gate_proj", "up_proj", "down_proj"]


def _where(target: str) -> str:
    return "self_attn" if target in ATTN else "mlp"


def make_adapter(path, hf_model, targets=ALL, r: int = 8, alpha: float = 16, rslora: bool = False, seed: int = 0,
                 std: float = 0.2, **config) -> dict:
    """Write an adapter for ``hf_model``'s shapes into folder ``path``; returns its tensors
    (name -> tensor) and writes ``config`` keys over the PEFT config."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, layer in enumerate(hf_model.model.layers):
        for t in targets:
            out_f, in_f = getattr(getattr(layer, _where(t)), t).weight.shape
            base = f"base_model.model.model.layers.{i}.{_where(t)}.{t}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(r, in_f, generator=g) * std
            tensors[f"{base}.lora_B.weight"] = torch.randn(out_f, r, generator=g) * std
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
           "use_rslora": rslora, "use_dora": False, "bias": "none", "modules_to_save": None, "lora_dropout": 0.0,
           "base_model_name_or_path": "tiny"}
    cfg.update(config)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return tensors


def merged_model(base_path, adapter_path, base=None, **load_kw):
    """transformers' model of ``base_path`` (fp32; ``load_kw``: more from_pretrained arguments, a
    ``gguf_file``), or a copy of the loaded model ``base``, with the adapter merged into its weights."""
    import copy

    import transformers
    model = copy.deepcopy(base) if base is not None else transformers.AutoModelForCausalLM.from_pretrained(
        str(base_path), dtype=torch.float32, **load_kw).eval()
    from safetensors.torch import load_file
    with open(os.path.join(adapter_path, "adapter_config.json")) as f:
        cfg = json.load(f)
    r = cfg["r"]
    scale = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    tensors = load_file(os.path.join(adapter_path, "adapter_model.safetensors"))
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            mod = model.get_submodule(name[len("base_model.model."):].split(".lora_A.")[0])
            mod.weight += (scale * (b.double() @ a.double())).float()
    return model
