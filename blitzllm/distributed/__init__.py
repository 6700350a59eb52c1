"""Tensor parallelism over torch.distributed (NCCL on CUDA, gloo on CPU).

- ``parallel_state``: the ``TPGroup`` a model is built for (``get_tp_group()`` inside
  ``building(group)``), process-group set-up from a TCP store, head / shard arithmetic.
- ``layers``: how a rank holds its part of each checkpoint tensor (``Part``), the
  column / row / vocab-parallel builders, the vocab-parallel embedding and lm_head.
- ``allreduce_norm``: the fused all-reduce + residual add + RMSNorm after attention and
  MLP (one-shot over symmetric memory for small CUDA batches, NCCL/gloo otherwise), and
  the full-width q/k norm from all-reduced partial sums of squares.
- ``launcher``: rank 0's side (spawn workers or join a torchrun world, broadcast each
  step, watch the workers, shut down); ``worker``: the other ranks' loop.

With ``tensor_parallel_size=1`` none of this runs: models build plain layers and no
process group exists.
"""
from .parallel_state import SINGLE, TPGroup, building, get_tp_group

__all__ = ["SINGLE", "TPGroup", "building", "get_tp_group"]
