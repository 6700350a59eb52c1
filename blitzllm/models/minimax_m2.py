"""MiniMax-M2: every layer attention + a sparse MoE block (``block_sparse_moe``).

Attention differs from Qwen3 in two ways: q_norm / k_norm are RMSNorms over the *whole*
q projection output (Hq * D values) and k projection output (Hkv * D) before the split
into heads (``qk_norm_type: per_layer``), and rotary covers only the first ``rotary_dim``
dims of each head. Routing: sigmoid scores, experts chosen by score +
``e_score_correction_bias``, weights = the chosen unbiased scores renormalised to sum 1
(no routed scaling, as transformers' MiniMaxM2 implementation).

Checkpoint names: ``block_sparse_moe.gate.weight``, ``block_sparse_moe.e_score_correction_bias``,
``block_sparse_moe.experts.<e>.{w1,w3,w2}.weight`` (gate, up, down). transformers' in-memory
names (``mlp.`` instead of ``block_sparse_moe.``, fused ``experts.gate_up_proj``) load too.
"""
from __future__ import annotations

from ..config import ModelConfig
from ..layers.moe import FusedMoE
from ..layers.rotary import RotaryEmbedding
from .llama import DecoderLayer
from .qwen3_moe import MoECausalLM, hf_text_config, num_routed_experts


class MiniMaxM2ForCausalLM(MoECausalLM):
    # transformers' module name -> ours (the checkpoint's); the loader accepts both, the
    # HF-peer export writes transformers' names
    hf_module_renames = {"mlp": "block_sparse_moe"}

    def make_layer(self, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding):
        hf = hf_text_config(cfg)
        scoring = hf.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ValueError(f"MiniMax-M2 scoring_func must be 'sigmoid', got {scoring!r}")
        if hf.get("shared_intermediate_size"):
            raise ValueError("MiniMax-M2 with shared experts (shared_intermediate_size > 0) is not supported")
        moe = FusedMoE(cfg.hidden_size, hf["intermediate_size"], num_routed_experts(hf), hf["num_experts_per_tok"],
                       scoring="sigmoid", correction_bias="block" if hf.get("use_routing_bias", True) else None,
                       renormalize=True,
                       expert_names=("w1", "w3", "w2"))
        return DecoderLayer(cfg, idx, rotary, moe, qk_norm="full", mlp_name="block_sparse_moe")

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        hf = hf_text_config(cfg)
        if hf.get("rotary_dim"):
            return int(hf["rotary_dim"])
        rp = hf.get("rope_parameters") or {}
        factor = rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        return int(cfg.head_dim * factor)
