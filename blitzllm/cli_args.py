"""Engine options shared by every ``blitz`` subcommand (generate, chat, serve, bench)."""
from __future__ import annotations

import argparse
import os
from typing import Optional


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="smollm2",
                   help="HF folder, .gguf file, 'smollm2' (default), 'preset:<name>' or a hub id")
    g.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16")
    g.add_argument("--weight-dtype", default=None,
                   help="store linear weights in this dtype: bfloat16 | float16 | int4 (CPU; int4 = GGUF Q4_1-style "
                        "groups of 32, lm_head in bf16) | fp8 (float8 e4m3 with a scale per 128x128 block: the "
                        "decoder's linears and MoE experts), activations keep --dtype")
    g.add_argument("--quantization", "-q", default=None,
                   choices=("fp8", "awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors"),
                   help="vLLM's flag: fp8 is --weight-dtype fp8 here (block-FP8 weights, 16-bit activations); "
                        "awq / gptq / compressed-tensors: the checkpoint's method, checked (read from it anyway)")
    g.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help='config.json keys set over the model\'s (vLLM\'s), e.g. \'{"max_position_embeddings": 16384}\'; '
                        "a *_config object (text_config) takes its keys one by one")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM command lines: blitzllm runs no code from a checkpoint, so nothing changes")
    g.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    g.add_argument("--load-format", default="auto", help="auto | dummy | safetensors | gguf")
    g.add_argument("--num-layers", type=int, default=None, help="keep only the first N layers (speed work)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--kv-cache-blocks", type=int, default=None)
    g.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"),
                   help="auto: the model's dtype; fp8 (= fp8_e4m3): keys and values stored as float8 e4m3, half "
                        "a 16-bit cache's bytes, so twice the tokens fit")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="the share of the GPU's memory the engine may fill (weights, activations, KV cache)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "priority"),
                   help="fcfs: arrival order; priority: each request's priority (lower first, then arrival), and "
                        "a waiting request preempts running ones of a lower priority")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-logprobs", type=int, default=20, metavar="N",
                   help="the most logprobs / prompt_logprobs a request may ask per token (vLLM's; -1: the vocabulary)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="shard the model over N ranks (GPUs; processes on CPU): one host spawns them, several "
                        "hosts start every rank with torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults for what a request leaves unset (temperature, top_p, top_k, min_p, "
                        "repetition_penalty, max_new_tokens): the model folder's generation_config.json (auto), "
                        "another folder's, or none (vllm)")
    g.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help='those keys over the generation config, e.g. \'{"temperature": 0.5}\'')
    g.add_argument("--tokenizer", default=None, metavar="FOLDER|FILE.gguf|ORG/NAME",
                   help="the tokenizer from elsewhere than the model (vLLM's): a folder, a .gguf file or a hub id")
    g.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) instead of the tokenizer's")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'; keys: '
                        "method (ngram | draft_model | eagle3 | mtp), num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, "
                        "model (draft), synthetic_acceptance_rate (benchmark only: forced acceptance)")
    g.add_argument("--pooler-config", default=None, metavar="JSON",
                   help='embeddings (/v1/embeddings, LLM.embed): how hidden states are pooled, e.g. '
                        '\'{"pooling_type": "MEAN", "normalize": false}\'; pooling_type LAST | MEAN | CLS (default: '
                        "the model folder's sentence-transformers files, else LAST), normalize (L2; default true)")


    g.add_argument("--mm-processor-kwargs", default=None, metavar="JSON",
                   help='a vision model\'s image bounds over its preprocessor_config.json, e.g. '
                        '\'{"min_pixels": 65536, "max_pixels": 1048576}\' (fewer pixels: fewer image tokens), and '
                        'the frames a video is sampled to, \'{"fps": 1}\' or \'{"num_frames": 16}\'')
    g.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help='the most images and videos one prompt may hold, e.g. \'{"image": 4, "video": 1}\' '
                        '(default: no limit)')


def engine_kwargs(a: argparse.Namespace) -> dict:
    weight_dtype = a.weight_dtype
    if a.quantization == "fp8":
        if weight_dtype not in (None, a.quantization):
            raise ValueError(f"--quantization {a.quantization} and --weight-dtype {weight_dtype}: give one of them")
        weight_dtype = a.quantization
    return dict(quantization=a.quantization if a.quantization != "fp8" else None, model=a.model, dtype=a.dtype, device=a.device, load_format=a.load_format,
                num_layers=a.num_layers, max_model_len=a.max_model_len, kv_cache_blocks=a.kv_cache_blocks,
                kv_cache_dtype=a.kv_cache_dtype,
                block_size=a.block_size, enable_prefix_caching=not a.no_prefix_caching,
                max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens, scheduling_policy=a.scheduling_policy, seed=a.seed,
                enforce_eager=a.enforce_eager, weight_dtype=weight_dtype, hf_overrides=a.hf_overrides,
                speculative_config=a.speculative_config, tensor_parallel_size=a.tensor_parallel_size,
                gpu_memory_utilization=a.gpu_memory_utilization, generation_config=a.generation_config,
                override_generation_config=a.override_generation_config, chat_template=a.chat_template, tokenizer=a.tokenizer,
                pooler_config=a.pooler_config, mm_processor_kwargs=a.mm_processor_kwargs,
                limit_mm_per_prompt=a.limit_mm_per_prompt, max_logprobs=a.max_logprobs)


def check_output_file(path: Optional[str], flag: str) -> None:
    """Fail before a long run, not after it: the folder of ``path`` (a results file) must exist."""
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ValueError(f"{flag}: the folder {folder} does not exist")


def check_listen_address(host: str, port: int) -> None:
    """A ValueError naming --host / --port where the server could not listen there, before it starts
    (uvicorn would log its own error lines first, and exit 3 for a host it cannot resolve)."""
    import socket
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host!r} is not an address to listen on ({e})") from None
