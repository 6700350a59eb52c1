"""The decode plan: decides once per engine, from the model's structure, the tensor-parallel size
and the knobs, which kernel form each module takes at decode, and marks it (a mark only selects
a form the module dispatches to at run time). Models know nothing of it
(docs/design.md#the-decode-plan).
"""
from __future__ import annotations

import torch
from torch import nn

from ..envs import Knobs
from ..layers.attention import Attention
from ..layers.linear import Linear
from ..layers.moe import FusedMoE
from ..layers.norm import RMSNorm


def _plain(linear) -> bool:
    """A single-device ``Linear`` (not a tensor-parallel subclass with its own forward)."""
    return isinstance(linear, Linear) and type(linear).forward is Linear.forward


def _decoder_layers(model: nn.Module) -> list:
    """The model's pre-norm decoder layers with a paged-attention block (models/llama.py's
    ``DecoderLayer`` and the MoE models built on it)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) or []
    return [layer for layer in layers
            if hasattr(layer, "self_attn") and hasattr(layer, "mlp_name")
            and isinstance(getattr(layer.self_attn, "attn", None), Attention)]


def apply_decode_plan(model: nn.Module, knobs: Knobs) -> None:
    """Mark ``model``'s modules with the decode forms of ``knobs`` (see the module docstring)."""
    for mod in model.modules():
        if isinstance(mod, Linear):
            mod.use_gemv = knobs.gemv and not knobs.reference
    if knobs.reference:
        return
    tma = knobs.gemv_tma
    layers = _decoder_layers(model)
    for layer in layers:
        attn = layer.self_attn
        if tma != "0" and _plain(attn.o_proj):
            attn.o_proj.tma_preload = True
            if tma != "nodeps":  # the attention lets it launch as it starts (a tuple: no submodule)
                attn.attn.preload_next = (attn.o_proj,)
        qkv = attn.qkv_proj
        if tma in ("1", "nodeps", "lm_head") and _plain(qkv) and type(qkv).forward_norm is Linear.forward_norm:
            qkv.tma_preload = True
            qkv.tma_early = tma != "nodeps"
    _plan_fp32_sums(model)
    _stack_shared_experts(model)
    head = getattr(model, "lm_head", None)
    if tma == "lm_head" and _plain(head):
        head.tma_preload = True


def _entry_projection(layer: nn.Module):
    """The ``Linear`` whose ``forward_norm`` takes a pre-norm layer's input (and its input norm):
    the qkv of models/llama.py's decoder layers, the qkv or GDN input projection of the hybrid
    layers (models/qwen3_next.py); None for other layers."""
    gdn = getattr(layer, "linear_attn", None)
    proj = gdn.in_proj if gdn is not None else getattr(getattr(layer, "self_attn", None), "qkv_proj", None)
    return proj if isinstance(proj, Linear) and (hasattr(layer, "mlp_name") or gdn is not None) else None


def _plan_fp32_sums(model: nn.Module) -> None:
    """Let an MoE block return its fp32 sum (``FusedMoE.fp32_sum``) where the next op is a
    residual add + RMSNorm that rounds it: the next layer's input norm (through
    ``Linear.forward_norm``) or the final norm, none of them summing over ranks."""
    inner = getattr(model, "model", None)
    layers = list(getattr(inner, "layers", None) or [])
    for i, layer in enumerate(layers):
        mlp = getattr(layer, getattr(layer, "mlp_name", "mlp"), None)
        if _entry_projection(layer) is None or not hasattr(mlp, "fp32_sum"):
            continue
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        norm = inner.norm if nxt is None else getattr(nxt, "input_layernorm", None)
        takes = nxt is None or _entry_projection(nxt) is not None
        mlp.fp32_sum = takes and isinstance(norm, RMSNorm) and norm.tp is None


def _stack_shared_experts(model: nn.Module) -> None:
    """On CUDA, stack each MoE block's gated shared expert as its expert E where it fits
    (``FusedMoE.stack_shared_expert``): one-token steps run it inside the grouped GEMMs. The
    stacks are copies; the memory of the weights they replace goes back before the KV cache is
    planned."""
    stacked = [m.stack_shared_expert() for m in model.modules() if isinstance(m, FusedMoE) and m.w13.is_cuda]
    if any(stacked):
        torch.cuda.empty_cache()
