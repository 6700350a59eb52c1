"""Dense pre-norm decoder (Llama, Qwen2, Qwen3) built from the shared layers, and the blocks
other decoders reuse (``DecoderLayer`` takes any MLP module; a model class overrides
``make_layer`` / ``rotary_dim``). Architecture only: which kernels decode runs is the
runner's decode plan, and the tensor-parallel shards are ``layers/parallel.py``'s.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
from torch import nn

from ..config import ModelConfig
from ..distributed.allreduce_norm import full_width_qk_norm
from ..layers.parallel import Part, lm_head, packed_column_linear, row_linear, shard_rows, vocab_embedding
from ..distributed.parallel_state import get_tp_group, split_heads
from ..kernels.gemv.gemv import glu_linear, glu_ok
from ..layers.attention import Attention
from ..layers.norm import Fp32Params, RMSNorm
from ..layers.rotary import RotaryEmbedding


class DecoderAttention(nn.Module):
    """``qk_norm``: None (per head when ``cfg.qk_norm``), "head" (over each head's D values, Qwen3)
    or "full" (over the whole q / k projection output, MiniMax-M2). Each tensor-parallel rank
    holds ``split_heads``' query and KV heads; a full-width norm all-reduces sums of squares."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm: str | None = None):
        super().__init__()
        d = cfg.head_dim
        tp = get_tp_group()
        h = split_heads(cfg.num_heads, cfg.num_kv_heads, tp)
        q_part = Part(0, h.q_start * d, h.num_heads * d, cfg.q_size)
        kv_part = Part(0, h.kv_start * d, h.num_kv_heads * d, cfg.kv_size)
        self.qkv_proj = packed_column_linear(cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.kv_size], tp,
                                             cfg.attention_bias, parts=[q_part, kv_part, kv_part])
        self.o_proj = row_linear(cfg.q_size, cfg.hidden_size, tp, part=replace(q_part, dim=1))
        qk_norm = qk_norm or ("head" if cfg.qk_norm else None)
        if qk_norm not in (None, "head", "full"):
            raise ValueError(f"qk_norm must be None, 'head' or 'full', got {qk_norm!r}")
        full = qk_norm == "full"
        # q_norm / k_norm live here so checkpoint names (self_attn.q_norm) match HF
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = shard_rows(RMSNorm(q_part.size if full else d, cfg.rms_norm_eps),
                                     q_part if full and tp.world_size > 1 else None)
            self.k_norm = shard_rows(RMSNorm(kv_part.size if full else d, cfg.rms_norm_eps),
                                     kv_part if full and tp.world_size > 1 else None)
        pre_norm = None
        if full and tp.world_size > 1:  # all ranks' heads together: the norm runs before the backend
            # (a plain callable: the norms stay registered here under their checkpoint names)
            pre_norm = partial(full_width_qk_norm, q_norm=self.q_norm, k_norm=self.k_norm, heads=h, head_dim=d, tp=tp)
        self.attn = Attention(h.num_heads, h.num_kv_heads, d, layer_idx, rotary,
                              None if pre_norm else self.q_norm, None if pre_norm else self.k_norm,
                              full_width_qk_norm=full and pre_norm is None, pre_norm=pre_norm)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.attend_project(positions, self.qkv_proj(x))

    def attend_project(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attn(positions, qkv))


class DenseMLP(nn.Module):
    """down(silu(gate(x)) * up(x)). Tensor parallel: gate/up rows and down_proj's input columns
    split over the ranks."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        tp = get_tp_group()
        self.gate_up_proj = packed_column_linear(hidden, [inter, inter], tp, what="intermediate_size")
        self.down_proj = row_linear(inter, hidden, tp, what="intermediate_size")

    def forward(self, x):
        gu = self.gate_up_proj
        if self.glu_ok(x):  # CUDA decode: the SiLU-and-mul in gate_up's GEMV epilogue
            return self.down_proj(glu_linear(x, gu.weight, gu.bias))
        return self.down_proj(gu(x), silu_mul_input=True)

    def glu_ok(self, x: torch.Tensor) -> bool:
        gu = self.gate_up_proj
        return (x.is_cuda and gu.use_gemv and gu.glu_epilogue and gu.qweight is None and gu.fp8_block is None
                and x.dtype == gu.weight.dtype and glu_ok(x, gu.weight))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block. ``mlp``: any [T, H] -> [T, H] module (default the
    dense gated MLP of the config); ``mlp_name`` is its checkpoint name."""

    def __init__(self, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding, mlp: nn.Module | None = None,
                 qk_norm: str | None = None, mlp_name: str = "mlp"):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, idx, rotary, qk_norm)
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp if mlp is not None else DenseMLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, get_tp_group())
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, get_tp_group())

    def forward(self, positions, x, residual):
        # each RMSNorm (with the residual add) goes to the projection after it, which may fuse
        # it or launch beside it (the runner's decode plan decides)
        attn, mlp = self.self_attn, getattr(self, self.mlp_name)
        qkv, residual = attn.qkv_proj.forward_norm(x, residual, self.input_layernorm)
        x = attn.attend_project(positions, qkv)
        x, residual = mlp_forward_norm(mlp, x, residual, self.post_attention_layernorm)
        if x.dtype != residual.dtype and self._forward_hooks:
            x = x.to(residual.dtype)  # hooks see the block's output as the next norm takes it (rounded)
        return x, residual


def mlp_forward_norm(mlp: nn.Module, x: torch.Tensor, residual, norm) -> tuple:
    """The post-attention half of a pre-norm block, (mlp(norm(x + residual)), x + residual); an MoE
    block may take the norm into its routing launch; the norm rounds an fp32 MoE sum x."""
    if hasattr(mlp, "norm_route_ok") and mlp.norm_route_ok(x, residual, norm):
        return mlp.forward_norm(x, residual, norm)
    h, residual = norm(x, residual)
    return mlp(h), residual


class DecoderModel(nn.Module):
    """``make_layer(cfg, idx, rotary)`` builds layer ``idx``; ``rotary_dim`` < head_dim
    rotates only the first dims of each head (partial rotary)."""

    def __init__(self, cfg: ModelConfig, make_layer=DecoderLayer, rotary_dim: int | None = None):
        super().__init__()
        rotary = RotaryEmbedding(rotary_dim or cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                 cfg.rope_scaling)
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size, get_tp_group())
        self.layers = nn.ModuleList(make_layer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, get_tp_group())

    def forward(self, input_ids, positions, inputs_embeds=None):
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


def build_in_dtype(ref: torch.Tensor, build):
    """``build()`` with new tensors made in ``ref``'s dtype and on its device: not in float32 and
    then cast (an MoE MTP layer is tens of GB in float32), and without a cast of what it shares
    (rotary tables stay float32). ``Fp32Params`` modules, which only a cast keeps in float32, are
    widened back after."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(ref.dtype)
    try:
        with torch.device(ref.device):
            module = build()
    finally:
        torch.set_default_dtype(prev)
    for mod in module.modules():
        if isinstance(mod, Fp32Params):
            mod.float()
    return module


class LlamaForCausalLM(nn.Module):
    # checkpoint sub-name -> (packed parameter sub-name, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, self.make_layer, self.rotary_dim(cfg))
        self.lm_head = lm_head(cfg.hidden_size, cfg.vocab_size, get_tp_group())
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_layer(self, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding) -> nn.Module:
        return DecoderLayer(cfg, idx, rotary)

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        return cfg.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds=None) -> torch.Tensor:
        """Flat tokens [T] (or given embeddings [T, hidden]) -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Logits [T, V]: float32, or (``fp32=False``) in the lm_head's dtype for consumers
        that upcast themselves (the samplers), which spares a copy of [T, V]."""
        logits = self.lm_head(hidden)
        return logits.float() if fp32 else logits


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
