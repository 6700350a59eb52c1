"""HF ``architectures`` name -> model class, imported on first use (a model file and its
kernels load only when a checkpoint asks for them)."""
from __future__ import annotations

import importlib

# architecture -> (module under blitzllm.models, class name)
MODEL_REGISTRY = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    "LlamaForSequenceClassification": ("seq_cls", "LlamaForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("seq_cls", "Qwen2ForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("seq_cls", "Qwen3ForSequenceClassification"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("deepseek_v32", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("deepseek_v32", "GlmMoeDsaForCausalLM"),
    "MiniMaxM2ForCausalLM": ("minimax_m2", "MiniMaxM2ForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_next", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_next", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_next", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_next", "Qwen3_5MoeForConditionalGeneration"),
}


def get_model_class(architecture: str):
    try:
        module, name = MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(sorted(MODEL_REGISTRY))}") from None
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)
