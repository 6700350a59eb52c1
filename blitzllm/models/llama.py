"""Dense pre-norm decoder (Llama, Qwen2, Qwen3) built from the shared layers.

Differences between the three are flags on ``ModelConfig``: q/k/v bias (Qwen2) and per-head
q/k RMSNorm (Qwen3). Checkpoint names follow HF; ``packed_modules`` declares how q/k/v and
gate/up are packed into single GEMMs at load time. Other decoders reuse the blocks:
``DecoderLayer`` takes any MLP module (MoE models pass a ``FusedMoE``), and a model class
overrides ``make_layer`` / ``rotary_dim`` (see qwen3_moe.py, minimax_m2.py).

Built inside ``distributed.building(group)`` the layers are this rank's tensor-parallel
shards (``distributed/layers.py``); the pre-norms sum the row-parallel partial outputs.
"""
from __future__ import annotations

import os
from dataclasses import replace

import torch
from torch import nn

from ..config import ModelConfig
from ..distributed.layers import Part, lm_head, packed_column_linear, row_linear, shard_rows, vocab_embedding
from ..distributed.parallel_state import get_tp_group, split_heads
from ..kernels._common import use_triton
from ..kernels.fused_mlp import FUSED_MLP, fused_mlp_ok, fused_mlp_triton
from ..kernels.gemv_tma import tma_for_lm_head, tma_for_qkv
from ..kernels.oproj_partials import oproj_partials_wanted
from ..kernels.gemv import (GEMV_MAX_ROWS, glu_linear, glu_ok, linear_add_ss, prefer_gemv, ss_norm_glu,
                            ss_norm_linear, sum_squares_slots)
from ..layers.attention import Attention
from ..layers.linear import GEMV_ENABLED, Linear
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding


class DecoderAttention(nn.Module):
    """``qk_norm``: None (from the config: per head when ``cfg.qk_norm``), "head" (RMSNorm
    over each head's D values, Qwen3) or "full" (over the whole q / k projection output,
    MiniMax-M2).

    Tensor parallel: each rank holds ``split_heads``' query heads and KV heads (q/k/v rows
    of the packed projection, o_proj's matching input columns); a full-width q/k norm
    holds its heads' slice of the weights and all-reduces sums of squares."""

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
            pre_norm = FullWidthQKNorm(self.q_norm, self.k_norm, h, d, tp)
        self.attn = Attention(h.num_heads, h.num_kv_heads, d, layer_idx, rotary,
                              None if pre_norm else self.q_norm, None if pre_norm else self.k_norm,
                              full_width_qk_norm=full and pre_norm is None, pre_norm=pre_norm)

        # set by DecoderModel where o_proj may merge the decode attention's partials itself
        # (BLITZ_ATTN_OPROJ=1, kernels/oproj_partials.py): a plain single-rank o_proj
        self.oproj_partials = False

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.attend_project(positions, self.qkv_proj(x))

    def attend_project(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """o_proj(attention(qkv)); where ``oproj_partials`` and the backend takes it (CUDA decode,
        ``Attention.forward_project``), o_proj's fp32 sum, which the residual add + RMSNorm after
        it rounds."""
        if self.oproj_partials:
            out = self.attn.forward_project(positions, qkv, self.o_proj)
            if out is not None:
                return out
        return self.o_proj(self.attn(positions, qkv))


class FullWidthQKNorm:
    """The full-width q/k RMSNorm of a tensor-parallel layer (a plain callable: the norms
    stay registered on ``DecoderAttention`` under their checkpoint names)."""

    def __init__(self, q_norm, k_norm, heads, head_dim, tp):
        self.norms, self.heads, self.head_dim, self.tp = (q_norm, k_norm), heads, head_dim, tp

    def __call__(self, qkv: torch.Tensor) -> torch.Tensor:
        from ..distributed.allreduce_norm import full_width_qk_norm
        return full_width_qk_norm(qkv, *self.norms, self.heads, self.head_dim, self.tp)


class DenseMLP(nn.Module):
    """Tensor parallel: gate/up rows and down_proj's input columns split over the ranks."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        tp = get_tp_group()
        self.gate_up_proj = packed_column_linear(hidden, [inter, inter], tp, what="intermediate_size")
        self.down_proj = row_linear(inter, hidden, tp, what="intermediate_size")
        self._single_rank = tp.world_size == 1

    def forward(self, x):
        if self.fused_ok(x):
            return fused_mlp_triton(x, self.gate_up_proj.weight, self.down_proj.weight)
        if self.glu_ok(x):
            gu = self.gate_up_proj
            return self.down_proj(glu_linear(x, gu.weight, gu.bias))
        return self.down_proj(self.gate_up_proj(x), silu_mul_input=True)

    def glu_ok(self, x: torch.Tensor) -> bool:
        """Whether CUDA decode runs gate_up with the SiLU-and-mul in its epilogue
        (kernels/gemv.py gemv_glu_triton; 1-2 rows, BLITZ_GEMV_GLU=0 turns it off)."""
        gu = self.gate_up_proj
        return (x.is_cuda and GEMV_ENABLED and gu.qweight is None and x.dtype == gu.weight.dtype
                and glu_ok(x, gu.weight))

    def fused_ok(self, x: torch.Tensor) -> bool:
        """Whether CUDA decode runs this MLP as one launch (kernels/fused_mlp.py; opt-in with
        BLITZ_FUSED_MLP=1): 1-2 rows, dense unbiased weights, one rank."""
        gu, d = self.gate_up_proj, self.down_proj
        return (FUSED_MLP and x.is_cuda and use_triton(x) and self._single_rank and gu.bias is None
                and d.bias is None and gu.qweight is None and d.qweight is None
                and fused_mlp_ok(x, gu.weight, d.weight))


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
        # each RMSNorm (with the residual add) enters the projection after it, so CUDA
        # decode runs it as that GEMV's prologue
        attn, mlp = self.self_attn, getattr(self, self.mlp_name)
        qkv, residual = attn.qkv_proj.forward_norm(x, residual, self.input_layernorm)
        x = attn.attend_project(positions, qkv)
        x, residual = mlp_forward_norm(mlp, x, residual, self.post_attention_layernorm)
        if x.dtype != residual.dtype and self._forward_hooks:
            x = x.to(residual.dtype)  # hooks see the block's output as the next norm takes it (rounded)
        return x, residual


    def chainable(self) -> bool:
        """Whether decode may run this layer as the GEMV norm chain (``forward_chain``): a
        dense MLP, unquantized projections without a tensor-parallel norm."""
        attn, mlp = self.self_attn, getattr(self, self.mlp_name)
        lins = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
        return (type(mlp) is DenseMLP and type(attn.attn) is Attention and attn.attn.pre_norm is None
                and all(isinstance(m, Linear) and m.qweight is None for m in lins)
                and self.input_layernorm.tp is None and self.post_attention_layernorm.tp is None)

    def chain_shapes(self, glu: bool = False) -> list:
        """(N, K, silu_mul_input) of the chained plain GEMVs: all four projections, or with
        ``glu`` (gate_up as the GLU GEMV, which takes any size) qkv, o_proj and a plain down_proj."""
        attn, mlp = self.self_attn, getattr(self, self.mlp_name)
        shapes = [(attn.qkv_proj.weight.shape[0], attn.qkv_proj.weight.shape[1], False),
                  (attn.o_proj.weight.shape[0], attn.o_proj.weight.shape[1], False)]
        if not glu:
            shapes.append((mlp.gate_up_proj.weight.shape[0], mlp.gate_up_proj.weight.shape[1], False))
        return shapes + [(mlp.down_proj.weight.shape[0], mlp.down_proj.weight.shape[1], not glu)]

    def forward_chain(self, positions, h, residual, slots):
        """``forward`` with every RMSNorm inside the GEMVs (kernels/gemv.py's norm chain):
        ``h`` is the normed input (the first layer) or None: then ``residual`` already holds
        x + residual and slot 1 its rows' sums of squares. Returns the new residual stream;
        slot 1 then holds its sums of squares (the next layer's input norm)."""
        attn, mlp = self.self_attn, getattr(self, self.mlp_name)
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if h is None:
            qkv = ss_norm_linear(residual, slots[1], attn.qkv_proj.weight, attn.qkv_proj.bias, norm1.weight,
                                 norm1.eps)
        else:
            qkv = attn.qkv_proj(h)
        o = attn.o_proj
        residual = linear_add_ss(attn.attn(positions, qkv), o.weight, o.bias, residual, slots[0], slots[1])
        gu, d = mlp.gate_up_proj, mlp.down_proj
        if mlp.glu_ok(residual):  # the SiLU-and-mul in gate_up's epilogue, a plain down_proj
            act = ss_norm_glu(residual, slots[0], gu.weight, gu.bias, norm2.weight, norm2.eps)
            return linear_add_ss(act, d.weight, d.bias, residual, slots[1], slots[0])
        gate_up = ss_norm_linear(residual, slots[0], gu.weight, gu.bias, norm2.weight, norm2.eps)
        return linear_add_ss(gate_up, d.weight, d.bias, residual, slots[1], slots[0], silu_mul_input=True)


def mlp_forward_norm(mlp: nn.Module, x: torch.Tensor, residual, norm) -> tuple:
    """The post-attention half of a pre-norm block: (mlp(norm(x + residual)), x + residual).
    A ``DenseMLP`` off the one-launch and GLU paths hands the norm to its gate_up
    (``norm_linear``: the GEMV's prologue on CUDA decode with BLITZ_GEMV_NORM=1); an MoE
    block may take the norm into its routing launch (``FusedMoE.forward_norm``). x may be an
    fp32 sum beside a lower-precision residual (the norm rounds it); the paths are chosen by
    the residual's dtype then."""
    probe = x if residual is None else residual  # (what the MLP's input will be: the norm's output)
    if isinstance(mlp, DenseMLP) and not mlp.fused_ok(probe) and not mlp.glu_ok(probe):
        gate_up, residual = mlp.gate_up_proj.forward_norm(x, residual, norm)
        return mlp.down_proj(gate_up, silu_mul_input=True), residual
    if hasattr(mlp, "norm_route_ok") and mlp.norm_route_ok(x, residual, norm):  # MoE: norm + routing fused
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
        self._wire_l2_prefetch()
        self._wire_fp32_sums()

    def _wire_fp32_sums(self):
        """Let an MoE block return its fp32 sum (``FusedMoE.fp32_sum``) where the next op is a
        residual add + RMSNorm that rounds it: the next decoder layer's input norm (through
        ``Linear.forward_norm``) or the final norm, none of them summing over ranks."""
        for i, layer in enumerate(self.layers):
            mlp = getattr(layer, getattr(layer, "mlp_name", "mlp"), None)
            if type(layer) is not DecoderLayer or not hasattr(mlp, "fp32_sum"):
                continue
            nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
            norm = self.norm if nxt is None else getattr(nxt, "input_layernorm", None)
            takes = nxt is None or (type(nxt) is DecoderLayer
                                    and isinstance(nxt.self_attn.qkv_proj, Linear))
            mlp.fp32_sum = takes and isinstance(norm, RMSNorm) and norm.tp is None

    def _wire_l2_prefetch(self):
        """Tell each layer's attention which weights decode reads after it, in order:
        o_proj, then (a dense MLP) gate_up and down and the next layer's qkv, or (an MoE
        block) its router and its shared experts' gate_up and down (the routed experts are
        not known before the router has run)."""
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, DecoderLayer) or not isinstance(layer.self_attn.attn, Attention):
                continue
            attn, mlp = layer.self_attn, getattr(layer, layer.mlp_name)
            mods = [attn.o_proj]
            if type(mlp) is DenseMLP:
                mods += [mlp.gate_up_proj, mlp.down_proj]
                nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
                if isinstance(nxt, DecoderLayer):
                    mods.append(nxt.self_attn.qkv_proj)
            elif isinstance(getattr(mlp, "gate", None), nn.Module) and hasattr(mlp.gate, "weight"):
                mods.append(mlp.gate)
                shared = getattr(mlp, "shared_experts", None)
                if type(shared) is DenseMLP:
                    mods += [shared.gate_up_proj, shared.down_proj]
                # (an MoE model: the MoE kernels are loaded)
                from ..kernels.moe import moe_pf_o_proj_wanted, moe_pf_qkv_wanted
                nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
                if moe_pf_qkv_wanted() and hasattr(mlp, "prefetch_next") and isinstance(nxt, DecoderLayer):
                    # the next layer's qkv (and o_proj) into the L2 from the norm + router launch
                    # (BLITZ_MOE_PF_QKV)
                    mlp.prefetch_next = (nxt.self_attn.qkv_proj,) + ((nxt.self_attn.o_proj,)
                                                                     if moe_pf_o_proj_wanted() else ())
            attn.attn.prefetch_modules = tuple(mods)
            attn.oproj_partials = (oproj_partials_wanted() and type(attn.o_proj) is Linear and attn.attn.pre_norm is None
                                   and get_tp_group().world_size == 1)
            # decode's o_proj and qkv as the TMA GEMV (layers/linear.py ``tma_preload``): o_proj
            # streams its weights while the attention runs, qkv while the input RMSNorm does
            if type(attn.o_proj).forward is Linear.forward:
                attn.o_proj.tma_preload = True
                attn.attn.preload_next = (attn.o_proj,)  # (a tuple: not a submodule)
            qkv = attn.qkv_proj
            if (type(qkv).forward is Linear.forward and type(qkv).forward_norm is Linear.forward_norm
                    and tma_for_qkv()):
                qkv.tma_preload = True

    def forward(self, input_ids, positions):
        x, residual = self.embed_tokens(input_ids), None
        if self._use_chain(x):
            h = self.layers[0].input_layernorm(x)
            slots = sum_squares_slots(x.device)
            for layer in self.layers:
                x, h = layer.forward_chain(positions, h, x, slots), None
            return self.norm(x)
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x

    # the GEMV norm chain (opt-in: BLITZ_NORM_CHAIN=1) for CUDA decode when every layer
    # qualifies and no layer is hooked. H200, qwen3-0.6b batch 1: 1103 tok/s vs 1164 without
    # (one atomic address per row), then 1140.7 vs 1164.0 (atomics over 32 lanes, residual
    # loaded before the PDL wait), at 5.25 vs 7.2 kernels per layer: the RMSNorm launches it
    # removes overlap their neighbours under PDL, the norm work it moves into the GEMVs does not.
    # With the GLU GEMV as gate_up (which lets it cover Llama-3.1-8B): llama 221.0 vs 241.3,
    # qwen3-0.6b 1254.5 vs 1274.8 tok/s (gpu_session.sh chainab)
    norm_chain = os.environ.get("BLITZ_NORM_CHAIN", "0") == "1"

    def _use_chain(self, x: torch.Tensor) -> bool:
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        if not (self.norm_chain and x.is_cuda and GEMV_ENABLED and 0 < rows <= GEMV_MAX_ROWS
                and use_triton(x) and len(self.layers) > 0):
            return False
        if any(layer._forward_hooks or layer._forward_pre_hooks for layer in self.layers):
            return False  # hooks see each layer's (x, residual) (spec/eagle3.py's HiddenCapture)
        if getattr(self, "_chain_layers_ok", None) is None:
            self._chain_layers_ok = self.norm.tp is None and all(
                isinstance(layer, DecoderLayer) and layer.chainable() for layer in self.layers)
        if not self._chain_layers_ok or x.dtype != self.layers[0].self_attn.qkv_proj.weight.dtype:
            return False
        layer0 = self.layers[0]
        glu = getattr(layer0, layer0.mlp_name).glu_ok(x)
        return all(prefer_gemv(rows, n, k, silu) for n, k, silu in layer0.chain_shapes(glu))


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
        if type(self.lm_head).forward is Linear.forward and tma_for_lm_head():
            self.lm_head.tma_preload = True  # decode logits through the TMA GEMV (kernels/gemv_tma.py)

    def make_layer(self, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding) -> nn.Module:
        return DecoderLayer(cfg, idx, rotary)

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        return cfg.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat tokens [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Logits [T, V]: float32, or (``fp32=False``) in the lm_head's dtype for consumers
        that upcast themselves (the samplers), which spares a copy of [T, V]."""
        logits = self.lm_head(hidden)
        return logits.float() if fp32 else logits


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
