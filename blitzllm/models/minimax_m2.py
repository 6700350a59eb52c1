"""MiniMax-M2: every layer attention + a sparse MoE block (``block_sparse_moe``); what differs from
Qwen3 is full-width q/k RMSNorms, partial rotary, sigmoid + bias routing without routed scaling
and the checkpoint names (docs/models.md). Architecture only.
"""
from __future__ import annotations

from ..config import ModelConfig
from ..layers.moe import FusedMoE
from ..layers.rotary import RotaryEmbedding
from .llama import DecoderLayer
from .qwen3_moe import MoECausalLM, num_routed_experts, partial_rotary_dim


class MiniMaxM2ForCausalLM(MoECausalLM):
    # transformers' module name -> ours (the checkpoint's); the loader accepts both, the
    # HF-peer export writes transformers' names
    hf_module_renames = {"mlp": "block_sparse_moe"}

    def make_layer(self, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding):
        hf = cfg.text_config
        scoring = hf.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ValueError(f"MiniMax-M2 scoring_func must be 'sigmoid', got {scoring!r}")
        if hf.get("shared_intermediate_size"):
            raise ValueError("MiniMax-M2 with shared experts (shared_intermediate_size > 0) is not supported")
        moe = FusedMoE(cfg.hidden_size, hf["intermediate_size"], num_routed_experts(hf), hf["num_experts_per_tok"],
                       scoring="sigmoid", correction_bias="block" if hf.get("use_routing_bias", True) else None,
                       renormalize=True, expert_names=("w1", "w3", "w2"))
        return DecoderLayer(cfg, idx, rotary, moe, qk_norm="full", mlp_name="block_sparse_moe")

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        hf = cfg.text_config
        return int(hf["rotary_dim"]) if hf.get("rotary_dim") else partial_rotary_dim(cfg, 1.0)
