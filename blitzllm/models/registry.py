"""HF ``architectures`` name -> model class, imported on first use (a model file and its
kernels load only when a checkpoint asks for them)."""
from __future__ import annotations

import importlib

# architecture -> (module under blitzllm.models, class name)
MODEL_REGISTRY = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "MiniMaxM2ForCausalLM": ("minimax_m2", "MiniMaxM2ForCausalLM"),
}


def get_model_class(architecture: str):
    try:
        module, name = MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(sorted(MODEL_REGISTRY))}") from None
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)
