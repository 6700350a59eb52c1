"""Who this process is in a tensor-parallel world: ``TPGroup`` (rank, world size, a device group
for tensors and a gloo group for step metadata, met through a TCP store). ``get_tp_group()``
is set only inside ``building(group)``, so a model built elsewhere (a draft) is single-rank.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import envs

# the control group waits for the next step as long as the engine idles
IDLE_TIMEOUT = datetime.timedelta(days=3650)
# environment every rank gets before NCCL starts (multicast / NVLS off)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(eq=False)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    device_group: Any = None      # torch ProcessGroup for tensors (None: no collectives possible)
    cpu_group: Any = None         # gloo ProcessGroup for step metadata
    device: Optional[torch.device] = None
    oneshot: Any = None           # CUDA one-shot all-reduce workspace (allreduce_norm.py), or None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; returns ``t``."""
        import torch.distributed as dist
        dist.all_reduce(t, group=self.device_group)
        return t

    def all_gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """[n, ...] on every rank -> [world * n, ...], rank 0's rows first (one collective,
        CUDA-graph capturable)."""
        import torch.distributed as dist
        out = t.new_empty((self.world_size * t.shape[0], *t.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, t.contiguous(), group=self.device_group)
        return out

    def split(self, full: int, what: str) -> tuple[int, int]:
        """(start, size) of this rank's even share of ``full`` items."""
        if full % self.world_size:
            raise ValueError(f"{what} ({full}) must be divisible by tensor_parallel_size ({self.world_size})")
        size = full // self.world_size
        return self.rank * size, size


SINGLE = TPGroup()

_BUILDING: list = []


@contextlib.contextmanager
def building(group: TPGroup):
    """Models constructed (and loaded) inside read ``group`` from ``get_tp_group()``."""
    if _BUILDING:
        raise RuntimeError("model builds cannot nest")
    _BUILDING.append(group)
    try:
        yield group
    finally:
        _BUILDING.clear()


def get_tp_group() -> TPGroup:
    """The group of the model being built; the single-rank group outside ``building``."""
    return _BUILDING[0] if _BUILDING else SINGLE


@dataclass(frozen=True)
class HeadSplit:
    """This rank's attention heads: ``num_heads`` query heads from ``q_start`` and
    ``num_kv_heads`` KV heads from ``kv_start``; each KV head is held by ``kv_replicas``
    ranks (more than one when there are fewer KV heads than ranks)."""
    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int
    kv_replicas: int


def split_heads(num_heads: int, num_kv_heads: int, tp: TPGroup) -> HeadSplit:
    n = tp.world_size
    q_start, hq = tp.split(num_heads, "num_attention_heads")
    if num_kv_heads >= n:
        kv_start, hkv = tp.split(num_kv_heads, "num_key_value_heads")
        return HeadSplit(hq, hkv, q_start, kv_start, 1)
    if n % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({n}) must be a multiple of num_key_value_heads "
                         f"({num_kv_heads}) when it is larger")
    replicas = n // num_kv_heads
    return HeadSplit(hq, 1, q_start, tp.rank // replicas, replicas)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """A rank's device: CUDA device ``index + local_rank`` (one GPU per rank of a host)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + local_rank)


# ---- process groups ---------------------------------------------------------------------

@dataclass(frozen=True)
class WorldEnv:
    """Where the ranks meet: torchrun's variables, or rank 0's choice for spawned workers."""
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def torchrun_env() -> Optional[WorldEnv]:
    """The torch.distributed environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``, optional ``LOCAL_RANK``) when it is set, else None."""
    e = os.environ
    if "RANK" not in e or "WORLD_SIZE" not in e:
        return None
    try:
        return WorldEnv(int(e["RANK"]), int(e["WORLD_SIZE"]), int(e.get("LOCAL_RANK", "0")),
                        e.get("MASTER_ADDR", "127.0.0.1"), int(e.get("MASTER_PORT", "29500")))
    except ValueError:
        raise ValueError("RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT must be integers") from None


def cpu_threads_per_rank(world_size: int, spawned: bool) -> int:
    """CPU threads for one rank: the host's cores shared by the ranks on it (all of them
    when rank 0 spawned them; torchrun's ``LOCAL_WORLD_SIZE`` otherwise). Idle OpenMP
    threads of one rank spin on cores another rank needs."""
    local = world_size if spawned else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // max(1, local))


def set_nccl_env() -> None:
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)


def connect_store(env: WorldEnv, timeout_s: float, is_master: Optional[bool] = None):
    """The TCP store of the world (rank 0 hosts it unless torchrun's agent does)."""
    import torch.distributed as dist
    if is_master is None:
        is_master = env.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore("blitz-tp", store)


def init_tp_group(env: WorldEnv, store, device: torch.device) -> TPGroup:
    """Join the world's process groups (every rank, same order). The caller attaches the
    one-shot all-reduce workspace (``allreduce_norm.attach_oneshot``), itself a collective."""
    import torch.distributed as dist
    if dist.is_initialized():
        raise RuntimeError("this process already has a torch.distributed world: one tensor-parallel "
                           "engine per process (close the other one first)")
    set_nccl_env()
    kw = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kw["device_id"] = device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=env.rank,
                            world_size=env.world_size, timeout=datetime.timedelta(seconds=envs.get("BLITZ_TP_TIMEOUT")), **kw)
    cpu = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TPGroup(env.rank, env.world_size, dist.group.WORLD, cpu, device)


def abort_tp_group(group: TPGroup) -> None:
    """Make collectives stuck on a dead peer fail (NCCL; gloo notices closed sockets)."""
    import torch.distributed as dist
    if group.device is not None and group.device.type == "cuda":
        with contextlib.suppress(Exception):
            dist.distributed_c10d._abort_process_group(group.device_group)


def destroy_tp_group() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
