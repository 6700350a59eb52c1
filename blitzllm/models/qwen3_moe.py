"""Qwen3-MoE: the Qwen3 decoder with a sparse MoE block (softmax top-k, ``norm_topk_prob``) in
place of the dense MLP, except in the dense layers of ``mlp_only_layers`` /
``decoder_sparse_step``; checkpoint names in docs/models.md. Architecture only.
"""
from __future__ import annotations

from ..config import ModelConfig
from ..layers.moe import FusedMoE, expert_load_keys, load_expert_weight
from ..layers.rotary import RotaryEmbedding
from .llama import DecoderLayer, LlamaForCausalLM


def num_routed_experts(hf: dict) -> int:
    """The routed expert count under its several spellings (Qwen, Mixtral/MiniMax, DeepSeek)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if hf.get(key):
            return int(hf[key])
    return 0


def partial_rotary_dim(cfg: ModelConfig, default_factor: float) -> int:
    """head_dim times ``partial_rotary_factor`` (in ``rope_parameters`` from transformers 5 on)."""
    hf = cfg.text_config
    rp = hf.get("rope_parameters") or {}
    return int(cfg.head_dim * rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", default_factor)))


class MoECausalLM(LlamaForCausalLM):
    """A decoder whose MLPs may be ``FusedMoE`` blocks: their stacked expert weights load
    through the helpers of layers/moe.py."""

    def load_custom_weight(self, name, tensor):
        return load_expert_weight(self, name, tensor)

    def required_load_keys(self, param_name):
        return expert_load_keys(self, param_name)


class Qwen3MoeForCausalLM(MoECausalLM):
    @staticmethod
    def is_sparse_layer(hf: dict, idx: int) -> bool:
        step = hf.get("decoder_sparse_step", 1) or 1
        return (idx not in (hf.get("mlp_only_layers") or []) and num_routed_experts(hf) > 0
                and (idx + 1) % step == 0)

    def make_layer(self, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding):
        hf = cfg.text_config
        if not self.is_sparse_layer(hf, idx):
            return DecoderLayer(cfg, idx, rotary)
        moe = FusedMoE(cfg.hidden_size, hf["moe_intermediate_size"], num_routed_experts(hf),
                       hf["num_experts_per_tok"], scoring="softmax",
                       renormalize=bool(hf.get("norm_topk_prob", False)))
        return DecoderLayer(cfg, idx, rotary, moe)
