"""Dense pre-norm decoder (Llama, Qwen2, Qwen3) built from the shared layers.

Differences between the three are flags on ``ModelConfig``: q/k/v bias (Qwen2) and per-head
q/k RMSNorm (Qwen3). Checkpoint names follow HF; ``packed_modules`` declares how q/k/v and
gate/up are packed into single GEMMs at load time. Other decoders reuse the blocks:
``DecoderLayer`` takes any MLP module (MoE models pass a ``FusedMoE``), and a model class
overrides ``make_layer`` / ``rotary_dim`` (see qwen3_moe.py, minimax_m2.py).
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.attention import Attention
from ..layers.linear import Linear, PackedLinear
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding


class DecoderAttention(nn.Module):
    """``qk_norm``: None (from the config: per head when ``cfg.qk_norm``), "head" (RMSNorm
    over each head's D values, Qwen3) or "full" (over the whole q / k projection output,
    MiniMax-M2)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm: str | None = None):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = PackedLinear(cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.kv_size], bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size)
        qk_norm = qk_norm or ("head" if cfg.qk_norm else None)
        if qk_norm not in (None, "head", "full"):
            raise ValueError(f"qk_norm must be None, 'head' or 'full', got {qk_norm!r}")
        full = qk_norm == "full"
        # q_norm / k_norm live here so checkpoint names (self_attn.q_norm) match HF
        self.q_norm = RMSNorm(cfg.q_size if full else d, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.kv_size if full else d, cfg.rms_norm_eps) if qk_norm else None
        self.attn = Attention(cfg.num_heads, cfg.num_kv_heads, d, layer_idx, rotary, self.q_norm, self.k_norm,
                              full_width_qk_norm=full)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attn(positions, self.qkv_proj(x)))


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = PackedLinear(hidden, [inter, inter])
        self.down_proj = Linear(inter, hidden)

    def forward(self, x):
        return self.down_proj(self.gate_up_proj(x), silu_mul_input=True)


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block. ``mlp``: any [T, H] -> [T, H] module (default the
    dense gated MLP of the config); ``mlp_name`` is its checkpoint name."""

    def __init__(self, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding, mlp: nn.Module | None = None,
                 qk_norm: str | None = None, mlp_name: str = "mlp"):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, idx, rotary, qk_norm)
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp if mlp is not None else DenseMLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual):
        # each RMSNorm (with the residual add) enters the projection after it, so CUDA
        # decode runs it as that GEMV's prologue
        attn, mlp = self.self_attn, getattr(self, self.mlp_name)
        qkv, residual = attn.qkv_proj.forward_norm(x, residual, self.input_layernorm)
        x = attn.o_proj(attn.attn(positions, qkv))
        return mlp_forward_norm(mlp, x, residual, self.post_attention_layernorm)


def mlp_forward_norm(mlp: nn.Module, x: torch.Tensor, residual, norm) -> tuple:
    """The post-attention half of a pre-norm block: (mlp(norm(x + residual)), x + residual).
    A ``DenseMLP`` takes the norm as its gate_up GEMV's prologue (CUDA decode)."""
    if isinstance(mlp, DenseMLP):
        gate_up, residual = mlp.gate_up_proj.forward_norm(x, residual, norm)
        return mlp.down_proj(gate_up, silu_mul_input=True), residual
    h, residual = norm(x, residual)
    return mlp(h), residual


class DecoderModel(nn.Module):
    """``make_layer(cfg, idx, rotary)`` builds layer ``idx``; ``rotary_dim`` < head_dim
    rotates only the first dims of each head (partial rotary)."""

    def __init__(self, cfg: ModelConfig, make_layer=DecoderLayer, rotary_dim: int | None = None):
        super().__init__()
        rotary = RotaryEmbedding(rotary_dim or cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                 cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_layer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


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
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_layer(self, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding) -> nn.Module:
        return DecoderLayer(cfg, idx, rotary)

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        return cfg.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat tokens [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
