"""The processes of a tensor-parallel engine: rank 0's ``TPDriver`` (start or join the world,
broadcast each step's inputs, watch and stop the workers) and ``run_worker`` for ranks 1..N-1
(build the same shards, run each step's forward until told to stop). Workers know nothing
about requests, sampling or text (docs/tensor-parallel.md).
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import weakref
from typing import Optional

import torch

from .. import envs
from ..distributed.allreduce_norm import attach_oneshot
from ..distributed.parallel_state import (TPGroup, WorldEnv, abort_tp_group, building, connect_store,
                                          cpu_threads_per_rank, destroy_tp_group, init_tp_group, rank_device,
                                          set_nccl_env, torchrun_env)

log = logging.getLogger("blitzllm.distributed")

WATCH_INTERVAL_S = 0.2
DEATH_GRACE_S = 2.0  # after a failed collective, how long to look for a worker that died


def _startup_timeout() -> float:
    return envs.get("BLITZ_TP_STARTUP_TIMEOUT")


class TPWorkerError(RuntimeError):
    """A tensor-parallel rank died or a step failed: the engine cannot go on."""


def check_shardable(cfg, world_size: int) -> None:
    """Raise the ValueError that building this model for ``world_size`` ranks would
    (heads, KV heads, intermediate sizes, experts), before any process starts."""
    from ..models.registry import get_model_class
    with building(TPGroup(0, world_size)), torch.device("meta"):
        get_model_class(cfg.architecture)(cfg)


def send(group: TPGroup, msg) -> None:
    import torch.distributed as dist
    dist.broadcast_object_list([msg], src=0, group=group.cpu_group)


def recv(group: TPGroup):
    import torch.distributed as dist
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group.cpu_group)
    return box[0]


def agree_min(group: TPGroup, value: int) -> int:
    """The smallest ``value`` over the ranks (the KV blocks every rank can hold)."""
    import torch.distributed as dist
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return int(t.item())


class TPDriver:
    """Held by rank 0's engine (and its runner): ``group``, ``send`` of step messages
    inside ``step()``, ``shutdown``. ``failure`` says why the world broke, once it has."""

    def __init__(self, group: TPGroup, procs: list, threads_before: Optional[int] = None):
        self.group = group
        self.procs = procs                # [(rank, multiprocessing.Process)] spawned here
        self._threads_before = threads_before  # this process's CPU threads before it became rank 0
        self.failure: Optional[str] = None
        self.workers_waiting = False      # every worker waits for rank 0's next message
        self.closed = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        # an engine dropped without close(): its workers go when the driver does
        self._finalizer = weakref.finalize(self, _abandon, list(procs))
        threading.Thread(target=_watch, args=(weakref.ref(self), self._stop), name="blitz-tp-watchdog",
                         daemon=True).start()

    # ---- start ----------------------------------------------------------------------
    @classmethod
    def launch(cls, args, world_size: int, device: torch.device) -> "TPDriver":
        """Start (one host) or join (torchrun) a world of ``world_size`` ranks as rank 0;
        ``device`` is rank 0's device (``parallel_state.rank_device``)."""
        set_nccl_env()
        env = torchrun_env()
        procs = []
        if env is None:
            if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + world_size:
                raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs from "
                                 f"{device}; this host has {torch.cuda.device_count()}")
            store = connect_store(WorldEnv(0, world_size, 0, "127.0.0.1", 0), _startup_timeout(), is_master=True)
            env = WorldEnv(0, world_size, 0, "127.0.0.1", store.underlying_store.port)
            ctx = mp.get_context("spawn")
            for r in range(1, world_size):
                p = ctx.Process(target=run_worker, args=(args, WorldEnv(r, world_size, r, env.master_addr,
                                                                          env.master_port), os.getpid()),
                                name=f"blitz-tp-rank{r}", daemon=True)
                p.start()
                procs.append((r, p))
        else:
            if env.world_size != world_size or env.rank != 0:
                raise ValueError(f"tensor_parallel_size={world_size} but the torch.distributed environment says "
                                 f"WORLD_SIZE={env.world_size}, RANK={env.rank}")
            store = connect_store(env, _startup_timeout())
        try:
            _wait_for_ranks(store, world_size, procs)
            group = attach_oneshot(init_tp_group(env, store, device))
        except BaseException:
            _kill(procs)
            raise
        threads = None
        if device.type == "cpu":  # rank 0 shares the cores with the ranks it spawned
            threads = torch.get_num_threads()
            torch.set_num_threads(cpu_threads_per_rank(world_size, spawned=bool(procs)))
        return cls(group, procs, threads)

    # ---- steps ----------------------------------------------------------------------
    def check(self) -> None:
        """Raise ``TPWorkerError`` if the world is broken (looks at the workers now)."""
        self._poll()
        if self.failure is not None:
            raise TPWorkerError(self.failure)

    def send(self, msg) -> None:
        self.check()
        send(self.group, msg)

    @contextlib.contextmanager
    def step(self):
        """Around one broadcast + forward: a dead rank or any error inside is fatal."""
        self.check()
        self.workers_waiting = False
        try:
            yield
        except Exception as e:
            self._fail_after(e, "step")
            raise TPWorkerError(self.failure) from e
        self.workers_waiting = True

    def agree_min(self, value: int) -> int:
        self.check()
        try:
            return agree_min(self.group, value)
        except Exception as e:
            self._fail_after(e, "start-up")
            raise TPWorkerError(self.failure) from e

    # ---- failure and shutdown ---------------------------------------------------------
    def _poll(self) -> None:
        for r, p in self.procs:
            if not p.is_alive():
                self._fail(f"tensor-parallel worker rank {r} (pid {p.pid}) died with exit code {p.exitcode}")
                return

    def _fail_after(self, e: Exception, what: str) -> None:
        """A collective failed: name the worker that died if one did (a peer's sockets close
        a moment before its process is reaped), else the error."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while self.failure is None and time.monotonic() < deadline:
            self._poll()
            time.sleep(0.02)
        self._fail(self.failure or f"tensor-parallel {what} failed: {type(e).__name__}: {e}")

    def _fail(self, why: str) -> None:
        with self._lock:
            if self.failure is not None or self.closed:
                return
            self.failure = why
        log.error("%s; stopping the other ranks", why)
        _kill(self.procs)
        abort_tp_group(self.group)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the workers (politely when they wait for a message, else by signal) and
        leave the process groups. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self._stop.set()
        if self.failure is None and self.workers_waiting:
            with contextlib.suppress(Exception):
                send(self.group, ("stop",))
            deadline = time.monotonic() + timeout
            for _, p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        _kill(self.procs)
        destroy_tp_group()
        self._finalizer.detach()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)


def _wait_for_ranks(store, world_size: int, procs: list) -> None:
    """Until every rank checked in to the store (a spawned worker that dies first, or a
    rank that never comes, is an error instead of a hang)."""
    keys = [f"up/{r}" for r in range(1, world_size)]
    deadline = time.monotonic() + _startup_timeout()
    while not store.check(keys):
        for r, p in procs:
            if not p.is_alive():
                raise TPWorkerError(f"tensor-parallel worker rank {r} exited with code {p.exitcode} while "
                                    "starting (its error is printed above)")
        if time.monotonic() > deadline:
            raise TPWorkerError(f"not every tensor-parallel rank joined within {_startup_timeout():.0f}s "
                                "(BLITZ_TP_STARTUP_TIMEOUT); check MASTER_ADDR / MASTER_PORT on every host")
        time.sleep(0.02)


def _watch(ref, stop: threading.Event) -> None:
    """The watchdog: polls the workers (holding the driver only weakly)."""
    while not stop.wait(WATCH_INTERVAL_S):
        driver = ref()
        if driver is None:
            return
        driver._poll()
        if driver.failure is not None:
            return
        del driver


def _abandon(procs: list) -> None:
    _kill(procs)
    destroy_tp_group()


def _kill(procs: list) -> None:
    for _, p in procs:
        if p.is_alive():
            p.terminate()
    for _, p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


# ---- ranks 1..N-1 ----------------------------------------------------------------------

def run_worker(args, env: WorldEnv, parent_pid: Optional[int] = None) -> None:
    """``args``: rank 0's EngineArgs; returns once rank 0 stops the world."""
    spawned = parent_pid is not None
    os.environ["BLITZ_NO_PROGRESS"] = "1"  # one loading bar (rank 0's)
    if spawned:  # the engine process decides when we stop (Ctrl-C is its)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="blitz-tp-parent", daemon=True).start()
    from .args import resolve_device
    device = rank_device(resolve_device(args.device), env.local_rank)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(env.world_size, spawned))
    store = connect_store(env, _startup_timeout())
    store.set(f"up/{env.rank}", str(os.getpid()))
    group = attach_oneshot(init_tp_group(env, store, device))
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


class _Stopped(Exception):
    """Rank 0 stopped the world before the runner was built (its own start-up failed)."""


def _build(args, group, device):
    """The same model shard, KV cache size (agreed with rank 0) and runner as rank 0 builds;
    None if rank 0 stops first."""
    from ..config import ModelConfig
    from ..loader.source import resolve_model
    from ..runner.build import build_runner
    from .args import (engine_cache_config, lora_config, plan_kv_blocks, resolve_dtype, resolve_weight_dtype,
                       speculation_runner_kwargs)
    src = resolve_model(args.model, args.load_format, args.hf_overrides)
    cfg = ModelConfig.from_hf(src.hf_config, args.num_layers)
    dtype = resolve_dtype(args.dtype, device, src.torch_dtype)

    def plan_cache():
        num_blocks = agree_min(group, plan_kv_blocks(args, cfg, dtype, device, group.world_size))
        msg = recv(group)
        if msg[0] == "stop":
            raise _Stopped
        return engine_cache_config(args, cfg, num_blocks), msg[1]

    try:
        return build_runner(src, cfg, device=device, dtype=dtype, plan_cache=plan_cache, seed=args.seed, tp=group,
                            weight_dtype=resolve_weight_dtype(args.weight_dtype, device, dtype),
                            max_num_seqs=args.max_num_seqs, attention_backend=args.attention_backend,
                            lora=lora_config(args), **speculation_runner_kwargs(args))
    except _Stopped:
        return None


@torch.inference_mode()
def _serve(runner, group) -> None:
    while True:
        msg = recv(group)
        kind = msg[0]
        if kind == "stop":
            return
        if kind in ("forward", "graph"):
            if msg[1] is not None:   # the step's LoRA slots (and adapters rank 0 loaded for it)
                runner.lora.apply_step(*msg[1])
            (runner.forward if kind == "forward" else runner.launch_decode_graph)(*msg[2:])
        elif kind == "kv_land":  # KV pulled from a producer (disaggregation): this rank's heads of it
            from ..kv_transfer import land_shard
            land_shard(runner.kv_caches, *msg[1:], group.rank, group.world_size)
        else:
            raise RuntimeError(f"unknown tensor-parallel message {kind!r}")


def _exit_with_parent(pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != pid:
            os._exit(1)
