"""Ranks 1..N-1 of a tensor-parallel engine: build the same model shard and KV cache shard
as rank 0 (same arguments, same order of collectives), then loop: receive a step's inputs,
run its forward (taking part in the collectives inside), until rank 0 says stop.

Started by rank 0 (spawned, ``parent_pid`` set: the worker exits when that process goes)
or by torchrun on any host. Knows nothing about requests, sampling or text.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional

import torch

from .launcher import STARTUP_TIMEOUT_S, agree_min, recv
from .parallel_state import (WorldEnv, connect_store, cpu_threads_per_rank, destroy_tp_group, init_tp_group, rank_device,
                             set_nccl_env)


def run_worker(args, env: WorldEnv, parent_pid: Optional[int] = None) -> None:
    """``args``: rank 0's EngineArgs; returns once rank 0 stops the world."""
    spawned = parent_pid is not None
    os.environ["BLITZ_NO_PROGRESS"] = "1"  # one loading bar (rank 0's)
    if spawned:  # the engine process decides when we stop (Ctrl-C is its)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="blitz-tp-parent", daemon=True).start()
    from ..engine.engine import resolve_device
    device = rank_device(resolve_device(args.device), env.local_rank)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(env.world_size, spawned))
    set_nccl_env()
    store = connect_store(env, STARTUP_TIMEOUT_S)
    store.set(f"up/{env.rank}", str(os.getpid()))
    group = init_tp_group(env, store, device)
    try:
        runner = _build(args, group, device)
        if runner is not None:
            _serve(runner, group)
    finally:
        destroy_tp_group()
    if spawned:  # stopped by rank 0: skip the interpreter's slow teardown (only stdio to flush)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _build(args, group, device):
    """The model shard, the agreed KV cache size and the runner; None if rank 0 stops
    before the runner (its own start-up failed)."""
    from ..config import CacheConfig, ModelConfig
    from ..engine.engine import plan_kv_blocks, resolve_dtype, resolve_weight_dtype, speculation_runner_kwargs
    from ..loader.source import resolve_model
    from ..runner.model_runner import ModelRunner, build_model
    src = resolve_model(args.model, args.load_format)
    cfg = ModelConfig.from_hf(src.hf_config, args.num_layers)
    dtype = resolve_dtype(args.dtype, device, src.torch_dtype)
    model = build_model(src, cfg, device, dtype, args.seed, resolve_weight_dtype(args.weight_dtype, device, dtype),
                        group)
    num_blocks = agree_min(group, plan_kv_blocks(args, cfg, dtype, device, group.world_size))
    msg = recv(group)
    if msg[0] == "stop":
        return None
    _, max_model_len = msg
    return ModelRunner(model, cfg, CacheConfig(args.block_size, num_blocks, args.enable_prefix_caching), device, dtype,
                       max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
                       attention_backend=args.attention_backend, tp=group, **speculation_runner_kwargs(args))


@torch.inference_mode()
def _serve(runner, group) -> None:
    while True:
        msg = recv(group)
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "forward":
            runner.forward(*msg[1:])
        elif kind == "graph":
            runner.launch_decode_graph(*msg[1:])
        else:
            raise RuntimeError(f"unknown tensor-parallel message {kind!r}")


def _exit_with_parent(pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != pid:
            os._exit(1)
