"""Tensor parallelism over torch.distributed (NCCL on CUDA, gloo on CPU), below the layers that
shard by it: process groups and head / shard arithmetic (``parallel_state``) and the
collectives inside a forward (``allreduce_norm``). With ``tensor_parallel_size=1`` none of it
runs. The parallel layers are ``layers/parallel.py``, the rank processes ``engine/tp.py``.
"""
from .parallel_state import SINGLE, TPGroup, building, get_tp_group

__all__ = ["SINGLE", "TPGroup", "building", "get_tp_group"]
