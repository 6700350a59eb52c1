"""What an engine is built from: ``EngineArgs`` and the device, dtype and KV cache size they
resolve to (the same on rank 0 and on every tensor-parallel worker)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from ..config import SCHEDULING_POLICIES, CacheConfig, ModelConfig
from ..kernels.attention.kv_store import kv_cache_dtype
from ..loader.source import parse_hf_overrides, read_generation_config
from ..pooling_params import parse_pooler_config
from ..sampling_params import SamplingParams
from ..spec.config import parse_speculative_config
from .state_cache import LOOKAHEAD_ROWS, StateLayout, state_bytes_per_row, state_layout

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
CPU_KV_BUDGET_BYTES = 2 << 30


@dataclass
class EngineArgs:
    model: str = "smollm2"
    dtype: Optional[Union[str, torch.dtype]] = None
    device: Optional[str] = None
    load_format: str = "auto"
    max_model_len: Optional[int] = None
    kv_cache_blocks: Optional[int] = None
    kv_cache_dtype: str = "auto"      # vLLM's: auto (the model's dtype) | fp8 | fp8_e4m3 (kernels/attention/kv_store.py)
    hf_overrides: Optional[Union[str, dict]] = None  # vLLM's: config.json keys set over the model's (loader/source.py)
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    # vLLM's: fcfs, or priority (each request's priority, lower first; engine/scheduler.py)
    scheduling_policy: str = "fcfs"
    seed: int = 0
    num_layers: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    attention_backend: str = "auto"   # auto | torch | triton
    # bfloat16 / float16 / int4 weights with float32 activations (CPU); fp8: block-FP8 (W8A16) linears and experts
    weight_dtype: Optional[str] = None
    warmup: bool = True               # CUDA: compile the kernels a first request needs at start-up
    speculative_config: Optional[Union[str, dict]] = None  # see blitzllm/spec/config.py
    tensor_parallel_size: int = 1     # ranks the model is sharded over (blitzllm/distributed/)
    kv_transfer_config: Optional[Union[str, dict]] = None  # P/D disaggregation (blitzllm/kv_transfer/)
    # vLLM's: the sampling defaults of the model's generation_config.json ("auto"), another folder's, or
    # none ("vllm"); then these keys over them
    generation_config: str = "auto"
    override_generation_config: Optional[Union[str, dict]] = None
    chat_template: Optional[str] = None  # a Jinja chat template, or a file holding one, over the tokenizer's
    tokenizer: Optional[str] = None      # vLLM's: the tokenizer from another folder, .gguf file or hub id
    # vLLM's multi-LoRA (blitzllm/lora, docs/lora.md): adapters per request, max_loras of them in a batch
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None
    enable_prompt_embeds: bool = False   # vLLM's: prompts may come as input embeddings (engine/prompt_embeds.py)
    # embeddings' defaults (vLLM's --pooler-config): {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool}
    pooler_config: Optional[Union[str, dict]] = None
    # vLLM's, for a vision model (engine/images.py): the image processor's pixel bounds
    # ({"min_pixels": N, "max_pixels": N} over preprocessor_config.json's), a video's frames
    # ({"fps": F} or {"num_frames": N}) and the items per prompt ({"image": N, "video": N})
    mm_processor_kwargs: Optional[Union[str, dict]] = None
    limit_mm_per_prompt: Optional[Union[str, dict]] = None
    # vLLM's: the most logprobs / prompt_logprobs a request may ask per token (-1: the whole vocabulary)
    max_logprobs: int = 20
    # vLLM's: fp8 is weight_dtype fp8; awq / gptq / compressed-tensors (and vLLM's *_marlin names) name
    # the checkpoint's own quantization, which is checked (it is read either way: loader/quantized.py)
    quantization: Optional[str] = None

    def __post_init__(self):
        if self.quantization == "fp8":
            if self.weight_dtype not in (None, "fp8"):
                raise ValueError(f"quantization fp8 and weight_dtype {self.weight_dtype}: give one of them")
            self.weight_dtype = "fp8"
        if self.weight_dtype is None and self.dtype is None:
            # neither asked: on the CPU a GGUF's quantized linears stay on their grid (resolve_weight_dtype)
            self.weight_dtype = "auto"


QUANTIZATIONS = (None, "fp8", "awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors")


def resolve_device(device: Optional[str]) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    return dev


def resolve_dtype(dtype, device: torch.device, config_dtype: Optional[str]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cpu":
            return torch.float32
        return torch.float16 if config_dtype == "float16" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}")
    return _DTYPES[dtype]


def resolve_weight_dtype(weight_dtype: Optional[str], device: torch.device, dtype: torch.dtype):
    if weight_dtype == "int4":
        if device.type != "cpu":
            raise ValueError("weight_dtype='int4' runs on the CPU only (torch's int4 CPU kernel)")
        return "int4"
    if weight_dtype == "fp8":
        return "fp8"
    if weight_dtype == "auto":  # build_model keeps a GGUF's quantized grid on the CPU (loader/gguf_grid.py)
        return "auto" if device.type == "cpu" else dtype
    if weight_dtype and weight_dtype not in _DTYPES:
        raise ValueError(f"weight_dtype must be one of float32, bfloat16, float16, int4, fp8; got {weight_dtype!r}")
    return _DTYPES[weight_dtype] if weight_dtype else dtype


def plan_kv_blocks(a: EngineArgs, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp_size: int = 1) -> int:
    """KV cache blocks: ``kv_cache_blocks``, else what fits this device's budget (one rank's
    share of the KV heads with tensor parallelism), at most what the model can use."""
    if a.kv_cache_blocks is not None:
        if not isinstance(a.kv_cache_blocks, int) or a.kv_cache_blocks < 1:
            raise ValueError(f"kv_cache_blocks must be an integer >= 1, got {a.kv_cache_blocks!r}")
        return a.kv_cache_blocks
    cache_bytes = kv_cache_dtype(a.kv_cache_dtype, dtype).itemsize
    per_block = cfg.kv_bytes_per_token(torch.finfo(dtype).bits // 8, tp_size, cache_bytes) * a.block_size
    spec = parse_speculative_config(a.speculative_config)
    if spec is not None and spec.method == "mtp" and cfg.state_layers:
        # a hybrid model's MTP layer keeps its K/V in the target's blocks: one attention layer more
        per_block += per_block // len(cfg.kv_layers)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserve = 4 << 30  # activations, logits, graphs
        budget = int(total * a.gpu_memory_utilization) - (total - free) - reserve
    else:
        budget = CPU_KV_BUDGET_BYTES
    layout = engine_state_layout(a, cfg)  # a hybrid model's recurrent states come out of the same budget
    if layout is not None:
        budget -= layout.total * state_bytes_per_row(cfg, torch.finfo(dtype).bits // 8, tp_size)
    if budget < per_block:
        raise ValueError(f"one KV block of {a.block_size} tokens takes {per_block} bytes, more than the KV cache "
                         f"budget of {max(budget, 0)} bytes: lower block_size (or give kv_cache_blocks)")
    want = -(-cfg.max_position_embeddings // a.block_size) * max(1, min(a.max_num_seqs, 64))
    return min(budget // per_block, want)


def lookahead_rows(args) -> int:
    """Spare rows for the runner's decode look-ahead: only where it looks ahead (CUDA graphs,
    one rank; ``ModelRunner`` and ``speculation_runner_kwargs`` decide the same way)."""
    if (args.tensor_parallel_size != 1 or args.attention_backend == "torch"
            or speculation_runner_kwargs(args)["enforce_eager"] or resolve_device(args.device).type != "cuda"):
        return 0
    return min(args.max_num_seqs, LOOKAHEAD_ROWS)


def engine_state_layout(args, cfg: ModelConfig) -> Optional[StateLayout]:
    """``state_layout`` of an engine's arguments (EngineArgs): the same on every rank."""
    spec = parse_speculative_config(args.speculative_config)
    return state_layout(cfg, args.max_num_seqs, args.enable_prefix_caching, spec.k if spec is not None else 0,
                        lookahead_rows(args))


def engine_cache_config(args, cfg: ModelConfig, num_blocks: int) -> CacheConfig:
    """The KV cache (and a hybrid model's state rows) of ``num_blocks`` blocks: the same on every rank."""
    layout = engine_state_layout(args, cfg)
    return CacheConfig(args.block_size, num_blocks, args.enable_prefix_caching,
                       layout.total if layout else 0, layout.spare if layout else 0, args.kv_cache_dtype)


def check_engine_args(a: EngineArgs) -> None:
    """Types and ranges of the plain arguments, before anything loads (a ValueError naming one)."""
    def integer(name: str, lo: int, hi: Optional[int] = None, optional: bool = False) -> None:
        v = getattr(a, name)
        if not (v is None and optional) and (not isinstance(v, int) or isinstance(v, bool) or v < lo
                                             or hi is not None and v > hi):
            raise ValueError(f"{name} must be an integer >= {lo}{f' and <= {hi}' if hi else ''}, got {v!r}")
    integer("max_num_seqs", 1)
    integer("max_num_batched_tokens", 1, optional=True)
    integer("num_layers", 1, optional=True)
    integer("seed", 0, 2**63 - 1)
    integer("block_size", 1)
    integer("max_logprobs", -1)
    if a.block_size & (a.block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 1, got {a.block_size}")
    for name in ("enable_prefix_caching", "enforce_eager", "warmup", "enable_lora", "enable_prompt_embeds"):
        if not isinstance(getattr(a, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(a, name)!r}")
    if not isinstance(a.kv_cache_dtype, str):
        raise ValueError(f"kv_cache_dtype must be a string (auto, fp8, fp8_e4m3), got {a.kv_cache_dtype!r}")
    kv_cache_dtype(a.kv_cache_dtype, torch.float32)  # (a ValueError naming the choices)
    parse_hf_overrides(a.hf_overrides)
    if a.quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(map(str, QUANTIZATIONS))}, got {a.quantization!r}")
    if a.scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                         f"got {a.scheduling_policy!r}")
    if a.enable_lora:
        lora_config(a)
    g = a.gpu_memory_utilization
    if not isinstance(g, (int, float)) or isinstance(g, bool) or not 0 < g <= 1:
        raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {g!r}")
    parse_pooler_config(a.pooler_config)
    from .images import parse_mm_args
    parse_mm_args(a.mm_processor_kwargs, a.limit_mm_per_prompt)
    if a.dtype is not None and not isinstance(a.dtype, (str, torch.dtype)):
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {a.dtype!r}")


def lora_config(a: EngineArgs):
    """The LoRAConfig of ``enable_lora`` (None without), its ranges checked. Any speculative
    method goes with it: the verify steps run under each row's adapter, so the output is the
    adapter's whatever proposed the drafts (a draft model or head proposes as it was trained,
    without the adapter, which only costs acceptance)."""
    if not a.enable_lora:
        return None
    from ..lora import LoRAConfig
    return LoRAConfig(a.max_loras, a.max_lora_rank, a.max_cpu_loras)


# generation_config.json keys -> the SamplingParams field a request leaves unset (vLLM's set)
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(a: EngineArgs, model_generation_config: dict) -> dict:
    """SamplingParams fields -> the values a request that leaves them unset gets (the server's
    requests, ``LLM.get_default_sampling_params``): the model's generation config (vLLM's
    ``--generation-config auto``), another folder's, or none (``vllm``), with
    ``override_generation_config`` over it. A ValueError names a bad value."""
    g = a.generation_config
    if not isinstance(g, str) or not g:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {g!r}")
    if g == "auto":
        cfg = dict(model_generation_config)
    elif g == "vllm":
        cfg = {}
    elif os.path.isdir(os.path.expanduser(g)):
        cfg = read_generation_config(Path(os.path.expanduser(g)))
    else:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {g!r} (no such folder)")
    over = a.override_generation_config
    if isinstance(over, str):
        try:
            over = json.loads(over)
        except json.JSONDecodeError as e:
            raise ValueError(f"override_generation_config is not valid JSON: {e}") from None
    if over is not None:
        if not isinstance(over, dict) or not set(over) <= set(GENERATION_KEYS):
            raise ValueError("override_generation_config must be an object of "
                             f"{', '.join(GENERATION_KEYS)}, got {a.override_generation_config!r}")
        cfg.update(over)
    out = {GENERATION_KEYS[k]: v for k, v in cfg.items() if k in GENERATION_KEYS and v is not None}
    try:
        SamplingParams(**out)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the generation config's sampling defaults {out} are not valid: {e}") from None
    return out


def check_tp_size(n) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {n!r}")
    return n


def speculation_runner_kwargs(args) -> dict:
    """ModelRunner options that depend on speculation, the same on every rank: an eager target for
    EAGLE-3 and MTP (their hooks miss graph replays), decode graphs over max_num_seqs * (k + 1)
    verify rows (at most 512)."""
    spec = parse_speculative_config(args.speculative_config)
    if spec is None:
        return {"enforce_eager": args.enforce_eager, "max_decode_rows": 0}
    return {"enforce_eager": args.enforce_eager or spec.method in ("eagle3", "mtp"),
            "max_decode_rows": min(args.max_num_seqs * (spec.k + 1), 512)}
