"""Tensor parallelism over torch.distributed (NCCL on CUDA, gloo on CPU): process groups and
the collectives inside a forward. Below the layers, which shard by it.

- ``parallel_state``: the ``TPGroup`` a model is built for (``get_tp_group()`` inside
  ``building(group)``), process-group set-up from a TCP store, head / shard arithmetic.
- ``allreduce_norm``: the fused all-reduce + residual add + RMSNorm after attention and
  MLP (one-shot over symmetric memory for small CUDA batches, NCCL/gloo otherwise), and
  the full-width q/k norm from all-reduced partial sums of squares.

The parallel layers (which part of each checkpoint tensor a rank holds) are
``layers/parallel.py``; the processes (rank 0's driver, the workers' loop) ``engine/tp.py``.

With ``tensor_parallel_size=1`` none of this runs: models build plain layers and no
process group exists.
"""
from .parallel_state import SINGLE, TPGroup, building, get_tp_group

__all__ = ["SINGLE", "TPGroup", "building", "get_tp_group"]
