"""The KV connector interface between an engine and a transfer engine (prefill/decode
disaggregation), and the plain data it passes around: a cache layout and a payload of pulled
blocks. Every per-request paged cache a model has (paged K/V, MLA latents, sparse-attention
index keys) is one *entry* here, so each of them moves the same way.

Scheduler side (the engine thread): ``remote_tokens`` (prompt tokens whose KV arrived with a
request), ``land`` (write it into the blocks just allocated), ``request_finished`` (a producer's
finished request keeps its blocks under a lease), ``tick`` (free released and expired leases).
Worker side: ``register_caches`` (the cache tensors a transport reads from and writes to) and
``load`` (pull a producer's blocks; any thread). Knows nothing about HTTP routes or requests'
sampling.
"""
from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from ..kernels.attention.kv_store import copy_rows


class KVLoadError(RuntimeError):
    """A consumer could not pull a request's KV (with ``kv_load_failure_policy`` 'fail': a 503)."""


def prompt_digest(ids) -> str:
    """Names a prompt's token ids, so a consumer never lands KV computed for another prompt."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class CacheLayout:
    """What a block holds: per entry (layer, tensor index) its per-block shape; plus the dtype,
    tokens per block and the tensor-parallel size. Two engines exchange KV only when equal.
    ``dtype`` names the tensors' dtype, or per tensor index joined by "/" where they differ (an fp8
    latent cache beside a sparse-attention indexer's 16-bit keys: "float8_e4m3fn/bfloat16")."""
    entries: tuple          # ((layer, index, (block_size, heads, dim)), ...)
    dtype: str
    block_size: int
    tp_size: int

    @classmethod
    def of(cls, kv_caches: list, block_size: int, tp_size: int) -> "CacheLayout":
        entries, dtypes = [], {}
        for layer, pair in enumerate(kv_caches):
            for j, t in enumerate(pair):
                if t is not None and t.shape[0] > 0:   # (layers without a paged cache hold 0 blocks)
                    entries.append((layer, j, tuple(t.shape[1:])))
                    dtypes[j] = str(t.dtype).replace("torch.", "")
        names = [dtypes[j] for j in sorted(dtypes)]
        return cls(tuple(entries), "/".join(names) if len(set(names)) > 1 else (names or ["none"])[0],
                   block_size, tp_size)

    def entry_dtype(self, j: int) -> torch.dtype:
        """The torch dtype of the entries of tensor index ``j``."""
        names = self.dtype.split("/")
        return getattr(torch, names[min(j, len(names) - 1)])

    def to_dict(self) -> dict:
        return {"entries": [[a, b, list(s)] for a, b, s in self.entries], "dtype": self.dtype,
                "block_size": self.block_size, "tp_size": self.tp_size}

    @classmethod
    def from_dict(cls, d: dict) -> "CacheLayout":
        return cls(tuple((a, b, tuple(s)) for a, b, s in d["entries"]), d["dtype"], int(d["block_size"]),
                   int(d["tp_size"]))

    def mismatch(self, remote: "CacheLayout") -> Optional[str]:
        """None when ``remote`` (the producer's) can land here (this, the consumer's), else why
        not. A producer of one rank may feed a consumer of several: each rank takes its heads."""
        sizes = f"the producer has tensor_parallel_size {remote.tp_size}, this consumer has {self.tp_size}"
        if remote.tp_size != self.tp_size and remote.tp_size != 1:
            return f"{sizes}: only a producer of size 1 can feed another size (its heads are re-sliced)"
        if remote.block_size != self.block_size:
            return f"block_size differs: the producer has {remote.block_size}, this consumer has {self.block_size}"
        if remote.dtype != self.dtype:
            return f"KV dtype differs: the producer has {remote.dtype}, this consumer has {self.dtype}"
        if len(remote.entries) != len(self.entries):
            return "the KV cache layouts differ (another model or layer count on the two sides)"
        for (la, ja, sa), (lb, jb, sb) in zip(remote.entries, self.entries):
            if (la, ja) != (lb, jb) or sa[0] != sb[0] or sa[2:] != sb[2:]:
                return "the KV cache layouts differ (another model or layer count on the two sides)"
            if head_range(sa[1], sb[1], 0, self.tp_size) is None:
                return f"{sizes}: {sa[1]} KV heads cannot be split into this consumer's {sb[1]} per rank"
        return None


def head_range(heads: int, local: int, rank: int, world: int) -> Optional[tuple]:
    """The [start, end) of a full cache's ``heads`` that rank ``rank`` of ``world`` holds as its
    ``local`` heads (the split of ``distributed.parallel_state.split_heads``: even shares, or one
    head replicated on world / heads ranks; a replicated MLA latent: all); None when impossible."""
    if local == heads:
        return 0, heads
    if heads >= world and heads % world == 0 and local == heads // world:
        return rank * local, (rank + 1) * local
    if heads < world and world % heads == 0 and local == 1:
        h = rank // (world // heads)
        return h, h + 1
    return None


def land_shard(kv_caches: list, entries: tuple, block_ids: list, tensors: list, rank: int, world: int) -> None:
    """Write full-head ``tensors`` ([blocks, block_size, heads, dim] per entry, a producer of one
    rank's) into this rank's blocks ``block_ids``, keeping the heads this rank holds."""
    idx = torch.tensor(block_ids, dtype=torch.long)
    for (layer, j, shape), t in zip(entries, tensors):
        cache = kv_caches[layer][j]
        lo, hi = head_range(t.shape[2], shape[1], rank, world)
        copy_rows(cache, idx.to(cache.device), t[:, :, lo:hi].to(cache.device))


@dataclass
class KVPayload:
    """KV pulled from a producer for a request's first ``num_tokens`` prompt tokens: per layout
    entry a [blocks, *block shape] tensor (block i holds tokens i*bs .. (i+1)*bs - 1)."""
    num_tokens: int
    tensors: list            # aligned with CacheLayout.entries


class KVConnector(ABC):
    def __init__(self, config):
        self.config = config
        self.layout: Optional[CacheLayout] = None
        self.kv_caches: list = []
        self.broadcast = None    # tensor parallel: sends a message to the other ranks (engine/tp.py)

    @property
    def is_producer(self) -> bool:
        return self.config.is_producer

    @property
    def is_consumer(self) -> bool:
        return self.config.is_consumer

    # ---- worker side ---------------------------------------------------------------
    @abstractmethod
    def register_caches(self, kv_caches: list, block_size: int, tp_size: int = 1) -> None:
        """The engine's cache tensors (rank 0's shard with ``tp_size`` ranks), once allocated."""

    @abstractmethod
    def load(self, params: dict, prompt_ids: list) -> Optional[KVPayload]:
        """Pull the blocks ``params`` (a producer's kv_transfer_params) name. Any thread; bounded
        by the transfer timeout. Failure: KVLoadError with policy 'fail', else None (recompute)."""

    # ---- scheduler side (engine thread) --------------------------------------------
    @staticmethod
    def remote_tokens(req) -> int:
        """Prompt tokens of a waiting request whose KV arrived with it (0: none, or already landed)."""
        p = getattr(req, "kv_payload", None)
        if p is None or req.prompt_logprobs is not None:  # (prompt logprobs need every position's logits)
            return 0
        return min(p.num_tokens, len(req.prompt_token_ids) - 1)

    @torch.inference_mode()
    def land(self, seqs, kv) -> None:
        """Write the payload of each request admitted this step into its blocks, past the ones its
        own prefix cache supplied (those are shared; never overwritten)."""
        for s in seqs:
            req = s.req
            p = getattr(req, "kv_payload", None)
            if p is None:
                continue
            n = self.remote_tokens(req)
            req.kv_payload = None
            if n == 0 or s.start < n:
                continue  # not admitted on the payload (prompt logprobs): recomputed
            table = kv.block_table(req.request_id)
            first = len(kv.hashes.get(req.request_id, ()))   # blocks matched in the prefix cache
            last = min(-(-n // kv.block_size), len(table), p.tensors[0].shape[0] if p.tensors else 0)
            if first >= last:
                continue
            parts = [t[first:last] for t in p.tensors]
            land_shard(self.kv_caches, self.layout.entries, table[first:last], parts, 0, self.layout.tp_size)
            if self.broadcast is not None:   # the other tensor-parallel ranks take their heads
                self.broadcast(("kv_land", self.layout.entries, table[first:last], parts))

    @abstractmethod
    def request_finished(self, req, kv) -> None:
        """A request finished: a producer's (``do_remote_decode``) keeps its blocks under a lease and
        ``req.kv_transfer_params`` becomes what a consumer needs; otherwise it becomes None."""

    @abstractmethod
    def tick(self, kv) -> None:
        """Free the blocks of released or expired leases (called between steps)."""

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass
