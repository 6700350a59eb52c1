"""Building a runner: the model (this rank's shard of it) with its weights and decode plan,
then its KV cache plan, then the ``ModelRunner``. One path for the engine, the tensor-parallel
workers and the draft-model proposer.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import torch

from ..config import ModelConfig
from ..distributed.parallel_state import SINGLE, TPGroup, building
from ..envs import Knobs
from ..loader.quantized import quantized_stream
from ..loader.source import ModelSource
from ..loader.weights import init_dummy_weights, load_weights
from ..models.registry import get_model_class
from .decode_plan import apply_decode_plan
from .model_runner import ModelRunner


def build_runner(src: ModelSource, cfg: ModelConfig, *, device: torch.device, dtype: torch.dtype,
                 plan_cache: Callable[[], tuple], weight_dtype=None, seed: int = 0, tp: TPGroup = SINGLE,
                 knobs: Optional[Knobs] = None, dummy_mtp: bool = False, lora=None, **runner_kw) -> ModelRunner:
    """The model, then ``plan_cache()`` -> (CacheConfig, max_model_len) once its weights are on the
    device (the KV cache sized from the memory left, agreed by the ranks), then the runner
    (``runner_kw``: ``ModelRunner``'s options). ``knobs``: default read from the environment now;
    ``dummy_mtp``: random MTP layers beside dummy weights (MTP speculation on a preset). ``lora``: a
    ``LoRAConfig``: the model's linears are wrapped for LoRA slots (``blitzllm/lora``) before the
    KV cache is planned, so the slots' memory is counted."""
    knobs = Knobs.from_env() if knobs is None else knobs
    model = build_model(src, cfg, device, dtype, seed, weight_dtype, tp, knobs)
    if dummy_mtp and src.tensors is None and hasattr(model, "dummy_mtp"):
        model.dummy_mtp(seed)
    manager = None
    if lora is not None:
        from ..lora.manager import LoRAManager
        manager = LoRAManager(model, cfg.architecture, lora, device, dtype, tp.world_size)
    cache, max_model_len = plan_cache()
    if cfg.is_classifier:   # (it never decodes: no decode graphs to capture, on any rank)
        runner_kw["enforce_eager"] = True
    return ModelRunner(model, cfg, cache, device, dtype, max_model_len=max_model_len, tp=tp, knobs=knobs,
                       lora=manager, **runner_kw)


def build_model(src: ModelSource, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int,
                weight_dtype=None, tp: TPGroup = SINGLE, knobs: Optional[Knobs] = None):
    """The model (this rank's shard of it when ``tp`` has several ranks: safetensors are
    read lazily, a part per rank) with its weights and decode plan, in eval mode."""
    with building(tp):
        model = _build_model(src, cfg, device, dtype, seed, weight_dtype, tp)
    apply_decode_plan(model, Knobs.from_env() if knobs is None else knobs)
    return model


def _build_model(src, cfg, device, dtype, seed, weight_dtype, tp):
    cls = get_model_class(cfg.architecture)
    with torch.device("meta"):
        model = cls(cfg)
    # cast on the meta device first: allocating in fp32 and then casting needs twice the memory
    # (torch.empty, not Module.to_empty: a meta empty_like imports sympy, half a second of start-up)
    model = model.to(dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    # buffers computed at init (rotary tables) are lost by the move: rebuild them
    for mod in model.modules():
        if hasattr(mod, "cos_sin_cache"):
            from ..layers.rotary import build_cos_sin_cache
            mod.cos_sin_cache = build_cos_sin_cache(mod.rotary_dim, cfg.max_position_embeddings,
                                                    cfg.rope_theta, cfg.rope_scaling).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if weight_dtype == "auto":  # none asked: a GGUF's quantized linears stay on their grid on the CPU,
        weight_dtype = dtype    # and so do a GPTQ / AWQ / compressed-tensors folder's 4-bit and 8-bit codes
        if device.type == "cpu" and src.kind == "hf" and tp.world_size == 1 and quantized_stream(src.hf_config):
            from ..loader.gguf_grid import apply_checkpoint_grids
            src = apply_checkpoint_grids(model, src)
        if device.type == "cpu" and src.kind == "gguf" and src.tensors is not None and tp.world_size == 1:
            from ..loader.gguf_file import gguf_config, iter_gguf_tensors, open_gguf
            from ..loader.gguf_grid import apply_gguf_grids
            reader = src.gguf_reader if src.gguf_reader is not None else open_gguf(src.path)[0]
            gcfg = gguf_config(reader)
            skip = apply_gguf_grids(model, reader, gcfg)  # (their float copies are never read)
            src = replace(src, tensors=lambda: iter_gguf_tensors(reader, gcfg, skip),
                          num_tensors=src.num_tensors - len(skip))
    if src.tensors is None:
        init_dummy_weights(model, seed, per_parameter_seeds=tp.world_size > 1)
    else:
        lazy = tp.world_size > 1 and src.slices is not None
        load_weights(model, src.slices() if lazy else src.tensors(), src.num_tensors)
    if weight_dtype == "int4":
        if device.type != "cpu":
            raise ValueError("weight_dtype='int4' runs on the CPU only (torch's int4 CPU kernel)")
        from ..layers.linear import quantize_linear_weights_int4
        quantize_linear_weights_int4(model)
    elif weight_dtype == "fp8":
        from ..kernels import fp8_weights
        from ..layers.linear import quantize_fp8_weights
        from ..loader.fp8 import fp8_block_size, fp8_pow2_scales
        quantize_fp8_weights(model, fp8_block_size(src.hf_config) or fp8_weights.WEIGHT_BLOCK,
                             fp8_pow2_scales(src.hf_config))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # (the 16-bit weights' memory back for the KV cache plan)
    elif weight_dtype is not None and weight_dtype != dtype:
        from ..layers.linear import cast_linear_weights
        cast_linear_weights(model, weight_dtype)
    model.eval()
    return model
