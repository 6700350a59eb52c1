"""DeepSeek-V3: MLA (``layers/mla.py``), dense MLPs in the first ``first_k_dense_replace``
layers and a sigmoid, grouped top-k ``FusedMoE`` with shared experts in the others, and the
MTP layers kept in ``mtp`` when the checkpoint has them (docs/models.md). Architecture only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.parallel import copy_part, lm_head, module_part
from ..distributed.parallel_state import get_tp_group
from ..layers.linear import Linear
from ..layers.mla import MLADims, MLAttention
from ..layers.moe import FusedMoE, load_expert_weight
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from .llama import DenseMLP, build_in_dtype, mlp_forward_norm
from .qwen3_moe import MoECausalLM


@dataclass(frozen=True)
class DeepseekV3Args:
    """The DeepSeek fields of the HF config that ``ModelConfig`` does not carry."""
    mla: MLADims
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    num_mtp_layers: int
    checkpoint_layers: int  # num_hidden_layers of the checkpoint (the MTP layers follow it)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "DeepseekV3Args":
        t = cfg.text_config
        # V3's routing (sigmoid scores, selection by score + correction bias); V2's softmax or
        # greedy selection would run wrongly here rather than fail
        for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if t.get(key, want) != want:
                raise ValueError(f"DeepseekV3ForCausalLM needs {key} {want!r} in config.json, got {t.get(key)!r}")
        mla = MLADims(
            hidden=cfg.hidden_size, num_heads=cfg.num_heads, q_lora_rank=t.get("q_lora_rank") or None,
            kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=t["qk_nope_head_dim"],
            qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=t["v_head_dim"],
            rope_interleave=bool(t.get("rope_interleave", True)), attention_bias=cfg.attention_bias)
        return cls(
            mla=mla, moe_intermediate_size=t.get("moe_intermediate_size") or 0,
            n_routed_experts=t.get("n_routed_experts") or 0, num_experts_per_tok=t.get("num_experts_per_tok") or 0,
            n_shared_experts=t.get("n_shared_experts") or 0, n_group=t.get("n_group") or 1,
            topk_group=t.get("topk_group") or 1, norm_topk_prob=bool(t.get("norm_topk_prob", True)),
            routed_scaling_factor=float(t.get("routed_scaling_factor") or 1.0),
            first_k_dense_replace=t.get("first_k_dense_replace") or 0, moe_layer_freq=t.get("moe_layer_freq") or 1,
            num_mtp_layers=t.get("num_nextn_predict_layers") or 0, checkpoint_layers=t["num_hidden_layers"])

    def attention(self, cache_idx: int, rotary: RotaryEmbedding, scale: float) -> nn.Module:
        """The attention block of a layer whose cache is ``kv_caches[cache_idx]``."""
        return MLAttention(self.mla, cache_idx, rotary, scale)

    def is_moe_layer(self, idx: int) -> bool:
        """By the layer's checkpoint index (an MTP layer counts from num_hidden_layers)."""
        return self.n_routed_experts > 0 and idx >= self.first_k_dense_replace and idx % self.moe_layer_freq == 0


def _make_mlp(cfg: ModelConfig, a: DeepseekV3Args, idx: int) -> nn.Module:
    if not a.is_moe_layer(idx):
        return DenseMLP(cfg.hidden_size, cfg.intermediate_size)
    shared = DenseMLP(cfg.hidden_size, a.moe_intermediate_size * a.n_shared_experts) if a.n_shared_experts else None
    return FusedMoE(cfg.hidden_size, a.moe_intermediate_size, a.n_routed_experts, a.num_experts_per_tok,
                    scoring="sigmoid", correction_bias="gate", n_group=a.n_group, topk_group=a.topk_group,
                    renormalize=a.norm_topk_prob, scaling=a.routed_scaling_factor, shared_experts=shared)


class DeepseekV3DecoderLayer(nn.Module):
    """``idx``: the checkpoint index (dense or MoE); ``cache_idx``: its KV cache slot."""

    def __init__(self, cfg: ModelConfig, a: DeepseekV3Args, idx: int, rotary: RotaryEmbedding,
                 cache_idx: Optional[int] = None):
        super().__init__()
        scale = a.mla.softmax_scale(cfg.rope_scaling)
        self.self_attn = a.attention(idx if cache_idx is None else cache_idx, rotary, scale)
        self.mlp = _make_mlp(cfg, a, idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, get_tp_group())
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, get_tp_group())

    def forward(self, positions, x, residual):
        # pre-norms enter the projection after them (a GEMV prologue on CUDA decode)
        x, residual = self.self_attn.forward_norm(positions, x, residual, self.input_layernorm)
        return mlp_forward_norm(self.mlp, x, residual, self.post_attention_layernorm)


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = lm_head(cfg.hidden_size, cfg.vocab_size, get_tp_group())


class MTPLayer(DeepseekV3DecoderLayer):
    """One DeepSeek MTP module: a decoder layer (its ``forward``) plus ``enorm`` / ``hnorm``,
    ``eh_proj`` [H, 2H] and ``shared_head``, which MTP speculation composes around it. The
    checkpoint's ``embed_tokens`` copy is the main embedding (DeepSeek shares it): not kept."""

    def __init__(self, cfg: ModelConfig, a: DeepseekV3Args, i: int, rotary: RotaryEmbedding):
        super().__init__(cfg, a, a.checkpoint_layers + i, rotary, cache_idx=cfg.num_layers + i)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.shared_head = SharedHead(cfg)


class MTPModules(nn.Module):
    """Weights of the MTP layers, ``layers.{i}`` = checkpoint layer num_hidden_layers + i."""

    def __init__(self, cfg: ModelConfig, a: DeepseekV3Args, rotary: RotaryEmbedding):
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(cfg, a, i, rotary) for i in range(a.num_mtp_layers))


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class DeepseekV3ForCausalLM(MoECausalLM):
    args_class = DeepseekV3Args

    def __init__(self, cfg: ModelConfig):
        if not cfg.is_mla:
            raise ValueError("DeepseekV3ForCausalLM needs kv_lora_rank > 0 in config.json")
        self.args = self.args_class.from_config(cfg)  # read by make_layer during super().__init__
        super().__init__(cfg)
        # checkpoint sub-name -> (packed parameter sub-name, shard index)
        self.packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                               **MLAttention.packed_modules(self.args.mla)}
        self.mtp: Optional[MTPModules] = None

    def make_layer(self, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding) -> nn.Module:
        return DeepseekV3DecoderLayer(cfg, self.args, idx, rotary)

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        return cfg.qk_rope_head_dim

    # ---- loading ------------------------------------------------------------------
    def load_custom_weight(self, name: str, tensor: torch.Tensor) -> Optional[list]:
        m = _LAYER.match(name)
        if m is not None and 0 <= int(m[1]) - self.args.checkpoint_layers < self.args.num_mtp_layers:
            return self._load_mtp(int(m[1]) - self.args.checkpoint_layers, m[2], tensor)
        return super().load_custom_weight(name, tensor)

    def _load_mtp(self, i: int, rest: str, tensor: torch.Tensor) -> list:
        if rest.startswith("embed_tokens."):
            return []  # DeepSeek's MTP shares the main embedding
        if self.mtp is None:
            self.mtp = self._new_mtp()
        local = f"layers.{i}.{rest}"
        keys = load_expert_weight(self.mtp, local, tensor)
        if keys is None:
            keys = [_copy_packed(self.mtp, self.packed_modules, local, tensor)]
        return [f"mtp.{k}" for k in keys]

    def dummy_mtp(self, seed: int) -> None:
        """Random MTP layers (the checkpoint's count) beside dummy weights: MTP speculation
        on a preset measures speed."""
        if self.mtp is None and self.args.num_mtp_layers:
            from ..loader.weights import init_dummy_weights
            self.mtp = self._new_mtp()
            init_dummy_weights(self.mtp, seed + 1)

    def _new_mtp(self) -> MTPModules:
        # in the model's dtype (DeepSeek-V3's MoE MTP layer alone is 42 GiB in float32)
        return build_in_dtype(self.model.norm.weight,
                              lambda: MTPModules(self.config, self.args, self.model.layers[0].self_attn.rotary))


def _copy_packed(root: nn.Module, packed: dict, name: str, tensor: torch.Tensor) -> str:
    """Copy checkpoint tensor ``name`` (relative to ``root``) into its parameter, or into its
    shard of a packed one; returns the load key."""
    *path, leaf = name.split(".")
    shard = None
    if len(path) and path[-1] in packed:
        path[-1], shard = packed[path[-1]]
    try:
        mod = root.get_submodule(".".join(path))
        param = getattr(mod, leaf)
    except AttributeError:
        param = None
    if not isinstance(param, torch.Tensor):
        raise ValueError(f"checkpoint tensor {name!r} has no place in DeepSeek's MTP layers")
    dst = param if shard is None else param[mod.shard_slice(shard)]
    copy_part(dst, tensor, module_part(mod, leaf, shard), name)
    return ".".join(path + [leaf]) + ("" if shard is None else f"#{shard}")
