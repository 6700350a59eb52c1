"""The collectives inside a tensor-parallel forward: ``all_reduce_add_rms_norm`` (a pre-norm
summing the ranks' partial sums, one-shot over symmetric memory for small CUDA messages, else
NCCL / gloo) and ``full_width_qk_norm`` (MiniMax-M2's q/k norm from all-reduced sums of
squares). Knows nothing about models or layers (docs/tensor-parallel.md).
"""
from __future__ import annotations

import logging
import warnings
from typing import Optional

import torch

from .. import envs
from ..kernels._common import use_triton
from ..kernels.norm.rmsnorm import fused_add_rms_norm, rms_norm
from .parallel_state import HeadSplit, TPGroup

log = logging.getLogger("blitzllm.distributed")


def all_reduce_add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                            tp: TPGroup) -> tuple:
    """``x``: this rank's partial sums [T, N]. Returns ``(rms_norm(sum(x) + residual),
    sum(x) + residual)``, identical on every rank; ``residual=None``: ``(rms_norm(sum(x)), sum(x))``."""
    ws = tp.oneshot
    if ws is not None and ws.fits(x):
        return ws.all_reduce_rms_norm(x, residual, weight, eps)
    x = tp.all_reduce(x.contiguous())
    if residual is None:
        return rms_norm(x, weight, eps), x
    return fused_add_rms_norm(x, residual, weight, eps)


class OneShotWorkspace:
    """A symmetric-memory buffer of ``BLITZ_TP_ONESHOT_BYTES`` per rank and the table of the
    ranks' buffer addresses. Made once at start-up (before CUDA-graph capture)."""

    def __init__(self, buf: torch.Tensor, handle, ptrs: torch.Tensor):
        self.buf, self.handle, self.ptrs = buf, handle, ptrs
        # a one-shot barrier still waiting after this long traps (a dead peer cannot hang the GPU)
        self.barrier_ms = int(envs.get("BLITZ_TP_BARRIER_TIMEOUT") * 1000)

    @classmethod
    def create(cls, tp: TPGroup) -> Optional["OneShotWorkspace"]:
        from ..kernels._common import HAS_TRITON
        nbytes = envs.get("BLITZ_TP_ONESHOT_BYTES")
        if not HAS_TRITON or nbytes <= 0:
            return None
        try:
            import torch.distributed._symmetric_memory as symm_mem
            name = tp.device_group.group_name
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a no-op later
                    symm_mem.enable_symm_mem_for_group(name)
            buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=tp.device)
            handle = symm_mem.rendezvous(buf, name)
            ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=tp.device)
        except Exception as e:  # no P2P between the GPUs, an old torch ...: NCCL for every size
            log.warning("one-shot all-reduce unavailable (%s: %s); using NCCL for every size", type(e).__name__, e)
            return None
        ws = cls(buf, handle, ptrs)
        try:  # (a failure here, a kernel that does not compile say, is the same on every rank)
            agrees = ws.agrees_with_nccl(tp)
        except Exception as e:
            log.warning("one-shot all-reduce failed its start-up check (%s: %s); using NCCL for every size",
                        type(e).__name__, e)
            return None
        if not agrees:
            log.warning("one-shot all-reduce disagrees with NCCL on this machine; using NCCL for every size")
            return None
        return ws

    def agrees_with_nccl(self, tp: TPGroup) -> bool:
        """Start-up check (every rank, same order): one fused call against NCCL + the norm
        on random data; the ranks agree on the verdict."""
        import torch.distributed as dist
        dev = tp.device
        x = torch.randn(3, 256, device=dev, generator=torch.Generator(device=dev).manual_seed(7 + tp.rank))
        g = torch.Generator(device=dev).manual_seed(1)
        residual, weight = torch.randn(3, 256, device=dev, generator=g), torch.rand(256, device=dev, generator=g)
        out, res = self.all_reduce_rms_norm(x, residual, weight, 1e-6)
        ref_out, ref_res = fused_add_rms_norm(tp.all_reduce(x.clone()), residual, weight, 1e-6)
        ok = torch.tensor([int(torch.allclose(res, ref_res, atol=1e-5, rtol=1e-5)
                               and torch.allclose(out, ref_out, atol=1e-4, rtol=1e-4))])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=tp.cpu_group)
        return bool(ok.item())

    def fits(self, x: torch.Tensor) -> bool:
        return use_triton(x) and x.dim() == 2 and x.numel() * x.element_size() <= self.buf.numel()

    def all_reduce_rms_norm(self, x, residual, weight, eps):
        from ..kernels.norm.allreduce_rmsnorm import oneshot_allreduce_rms_norm_triton
        rows, n = x.shape
        local = self.buf[: rows * n * x.element_size()].view(x.dtype).view(rows, n)
        self.handle.barrier(channel=0, timeout_ms=self.barrier_ms)  # all have read the last call's buffers
        local.copy_(x)
        self.handle.barrier(channel=0, timeout_ms=self.barrier_ms)  # every rank's partial sums are in place
        return oneshot_allreduce_rms_norm_triton(self.ptrs, rows, n, residual, weight, eps, x.dtype)


def attach_oneshot(group: TPGroup) -> TPGroup:
    """Give a CUDA group its one-shot all-reduce workspace (every rank, same order)."""
    if group.device is not None and group.device.type == "cuda":
        group.oneshot = OneShotWorkspace.create(group)
    return group


def full_width_qk_norm(qkv: torch.Tensor, q_norm, k_norm, heads: HeadSplit, head_dim: int, tp: TPGroup) -> torch.Tensor:
    """qkv [T, (hq + 2 hkv) * D] of this rank's heads -> the same with q and k normalized
    over all heads of all ranks (``q_norm`` / ``k_norm``: RMSNorms holding this rank's
    slice of the full-width weights). A replicated KV head counts once."""
    hq, hkv, d = heads.num_heads, heads.num_kv_heads, head_dim
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    sums = torch.stack([q.float().square().sum(-1), k.float().square().sum(-1) / heads.kv_replicas], 1)
    tp.all_reduce(sums)
    q_width, k_width = hq * d * tp.world_size, hkv * d * tp.world_size // heads.kv_replicas

    def scale(x, total, width, norm):
        normed = (x.float() * torch.rsqrt(total / width + norm.eps)[:, None]).to(x.dtype)
        return (norm.weight.float() * normed.float()).to(x.dtype)

    return torch.cat([scale(q, sums[:, 0], q_width, q_norm), scale(k, sums[:, 1], k_width, k_norm), v], 1)
