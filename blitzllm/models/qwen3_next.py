"""Qwen3-Next and Qwen3.5: hybrid decoders of gated delta net layers (``layers/gdn.py``) and
gated full attention (``layers/gated_attention.py``), every RMSNorm scaling by (1 + w)
(``OffsetRMSNorm``).

Layer ``i`` is ``layer_types[i]`` ("linear_attention" or "full_attention"; by default every
``full_attention_interval``-th layer, 4, is full attention: ``ModelConfig.state_layers``). MLPs: Qwen3-Next's sparse MoE
blocks (softmax top-k, ``norm_topk_prob``, on the ``decoder_sparse_step`` grid but for
``mlp_only_layers``), Qwen3.5 dense, Qwen3.5-MoE every layer an MoE block with renormalized
top-k; MoE blocks add a shared expert scaled by sigmoid(``shared_expert_gate``(x)).

The multimodal checkpoints (``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``)
load as their text model (``text_config``, weights under ``model.language_model.*``) and their
vision tower (``model.visual.*``, ``qwen3_5_vision.py``) as ``visual``, run by ``embed_images``. The
multi-token-prediction layers (``mtp.*``, also of the multimodal folders) load into ``mtp``
(``qwen3_next_mtp.py``) for MTP speculation.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..distributed.parallel_state import get_tp_group
from ..layers.gated_attention import GatedAttention
from ..layers.gdn import GatedDeltaNet
from ..layers.linear import Linear
from ..layers.moe import FusedMoE, find_module
from ..layers.norm import OffsetRMSNorm
from ..layers.rotary import RotaryEmbedding, mrope_rows
from .llama import DenseMLP, mlp_forward_norm
from .qwen3_5_vision import Qwen3_5VisionTower
from .qwen3_moe import MoECausalLM, Qwen3MoeForCausalLM, num_routed_experts, partial_rotary_dim
from .qwen3_next_mtp import MTPLoading


class SharedExpertMoE(FusedMoE):
    """Routed experts plus a shared expert scaled by sigmoid(``shared_expert_gate``(x)); the
    routed sum is rounded to x's dtype before the add, as transformers does."""

    def __init__(self, hidden: int, shared_intermediate: int, *args, **kw):
        super().__init__(hidden, *args, **kw)
        self.shared_expert = DenseMLP(hidden, shared_intermediate) if shared_intermediate else None
        self.shared_expert_gate = Linear(hidden, 1) if shared_intermediate else None

    def shared_parts(self):
        return None if self.shared_expert is None else (self.shared_expert, self.shared_expert_gate)

    def _experts(self, x: torch.Tensor, route, stacked: bool = False) -> torch.Tensor:
        if stacked:  # (the shared expert is the routing's last entry)
            return super()._experts(x, route, True)
        out = super()._experts(x, route).to(x.dtype)
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class HybridLayer(nn.Module):
    """Pre-norm block: (1 + w) norm, GDN (``linear_attn``) or gated attention (``self_attn``),
    (1 + w) norm, MLP or MoE block (``mlp``)."""

    def __init__(self, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding, mlp: nn.Module, layout: str):
        super().__init__()
        hf = cfg.text_config
        eps, tp = cfg.rms_norm_eps, get_tp_group()
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {hf.get('hidden_act')!r}")
        self.linear_attn = self.self_attn = None
        if idx in cfg.state_layers:
            self.linear_attn = GatedDeltaNet(
                cfg.hidden_size, hf["linear_num_key_heads"], hf["linear_key_head_dim"], hf["linear_num_value_heads"],
                hf["linear_value_head_dim"], hf["linear_conv_kernel_dim"], eps, idx, layout)
        else:
            self.self_attn = GatedAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, eps, idx,
                                            rotary, cfg.attention_bias)
            self.mlp_name = "mlp"  # (the runner's decode plan wires attention layers that name their MLP)
        self.mlp = mlp
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, eps, tp)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, eps, tp)

    def forward(self, positions, x, residual):
        if self.linear_attn is not None:
            proj, residual = self.linear_attn.in_proj.forward_norm(x, residual, self.input_layernorm)
            x = self.linear_attn.mix(proj)
        else:
            proj, residual = self.self_attn.qkv_proj.forward_norm(x, residual, self.input_layernorm)
            x = self.self_attn.attend_project(positions, proj)
        return mlp_forward_norm(self.mlp, x, residual, self.post_attention_layernorm)


class Qwen3NextForCausalLM(MTPLoading, MoECausalLM):
    layout = "qkvz"  # the GDN projections' checkpoint layout (layers/gdn.py)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.model.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, get_tp_group())
        self.mtp, self._mtp_keys = None, None   # the MTP layers, when the checkpoint has them

    def make_mlp(self, cfg: ModelConfig, idx: int) -> nn.Module:
        hf = cfg.text_config
        if not Qwen3MoeForCausalLM.is_sparse_layer(hf, idx):
            return DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        return SharedExpertMoE(cfg.hidden_size, int(hf.get("shared_expert_intermediate_size") or 0),
                               hf["moe_intermediate_size"], num_routed_experts(hf), hf["num_experts_per_tok"],
                               scoring="softmax", renormalize=self.renormalize(hf))

    @staticmethod
    def renormalize(hf: dict) -> bool:
        return bool(hf.get("norm_topk_prob", True))

    def make_layer(self, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding) -> nn.Module:
        return HybridLayer(cfg, idx, rotary, self.make_mlp(cfg, idx), self.layout)

    def make_mtp_layer(self, cfg: ModelConfig, i: int) -> nn.Module:
        """MTP layer ``i``: gated attention at cache index num_layers + i (past every state layer),
        the MLP of layer 0's kind (as vLLM and SGLang build it), the model's rotary."""
        rotary = next((layer.self_attn.attn.rotary for layer in self.model.layers if layer.self_attn is not None), None)
        if rotary is None:  # (a num_layers override left no attention layer)
            rotary = RotaryEmbedding(self.rotary_dim(cfg), cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        return HybridLayer(cfg, cfg.num_layers + i, rotary, self.make_mlp(cfg, 0), self.layout)

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        return partial_rotary_dim(cfg, 0.25)

    def state_layers(self) -> list:
        """The GDN layers, whose per-sequence states the runner keeps in its state pool."""
        return [layer.linear_attn for layer in self.model.layers if layer.linear_attn is not None]

    # ---- loading: GDN projections, q_proj's gate rows and the (1 + w) norms by their modules --
    def load_custom_weight(self, name, tensor):
        if name.startswith("mtp."):
            return self._load_mtp(name, tensor)
        keys = super().load_custom_weight(name, tensor)
        return keys if keys is not None else self.load_by_owner(name, tensor)

    def load_by_owner(self, name, tensor):
        """A tensor its module loads itself (``load_checkpoint``), or None."""
        parts = name.split(".")
        for cut in (1, 2):
            owner = find_module(self, ".".join(parts[:-cut]))
            if hasattr(owner, "load_checkpoint"):
                return owner.load_checkpoint(".".join(parts[-cut:]), tensor, name)
        return None

    def required_load_keys(self, param_name):
        keys = super().required_load_keys(param_name)
        if keys is None and param_name.endswith(".in_proj.weight"):
            prefix = param_name[:-len(".in_proj.weight")]
            owner = find_module(self, prefix)
            if isinstance(owner, GatedDeltaNet):
                return owner.required_keys(prefix)
        return keys


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    layout = "qkv"


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    @staticmethod
    def renormalize(hf: dict) -> bool:
        return True  # (Qwen3.5-MoE's router always renormalizes its top-k)


class _TextOfMultimodal:
    """A multimodal Qwen3.5 folder: ``model.language_model.*`` is ours ``model.*``, the vision tower
    (``model.visual.*``, when the config has a ``vision_config``) ours ``visual`` (plain
    parameters, whole on every rank), the MTP layers (top-level ``mtp.*``) ``mtp``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        hf = cfg.hf_config
        vision = hf.get("vision_config")
        self.visual = Qwen3_5VisionTower(vision) if vision else None
        # (transformers' Qwen3_5Config defaults where config.json leaves them out)
        self.image_token_id = int(hf.get("image_token_id", 248056))
        self.video_token_id = int(hf.get("video_token_id", 248057))
        self.vision_start_token_id = int(hf.get("vision_start_token_id", 248053))
        self.vision_end_token_id = int(hf.get("vision_end_token_id", 248054))
        self.spatial_merge_size = self.visual.merge if self.visual is not None else None
        rope = cfg.text_config.get("rope_parameters") or cfg.text_config.get("rope_scaling") or {}
        self.mrope_section = tuple(rope.get("mrope_section") or (11, 11, 10))

    def checkpoint_name(self, name: str):
        if name.startswith("model.visual."):
            return None if self.visual is None else name[len("model."):]
        return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name

    def embed_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The images' embeddings for their placeholder tokens, [sum(t*h*w) // merge**2, hidden],
        images in order (pixel_values and grid_thw as ``engine/multimodal.py``'s ImageProcessor gives)."""
        if self.visual is None:
            raise ValueError(f"{type(self).__name__} has no vision tower (config.json has no vision_config)")
        w = self.visual.patch_embed.proj.weight
        return self.visual(pixel_values.to(device=w.device, dtype=w.dtype), grid_thw)

    def mrope_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Interleaved M-RoPE cos/sin rows [T, rotary_dim] of positions [3, T] (time, height, width)."""
        rotary = next(layer.self_attn.attn.rotary for layer in self.model.layers if layer.self_attn is not None)
        return mrope_rows(rotary.cos_sin_cache, positions, self.mrope_section)


class Qwen3_5ForConditionalGeneration(_TextOfMultimodal, Qwen3_5ForCausalLM):
    pass


class Qwen3_5MoeForConditionalGeneration(_TextOfMultimodal, Qwen3_5MoeForCausalLM):
    pass
