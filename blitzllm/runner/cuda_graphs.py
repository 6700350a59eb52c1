"""CUDA graphs for pure-decode steps: one graph per batch-size bucket (1, 2, 4, 8, ...),
captured at start-up, largest first, from one shared memory pool. A step's batch is padded
to the next bucket (padding rows write nothing and read one cached token).

Each graph covers the model forward and the lm_head; sampling runs after it.
"""
from __future__ import annotations

import sys
import time

import torch

from ..layers.attention import AttentionMetadata, ForwardContext, forward_context


def decode_buckets(max_num_seqs: int) -> list[int]:
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    out.append(max_num_seqs)
    return out


class DecodeGraphs:
    def __init__(self, model, kv_caches, backend, device, max_num_seqs: int, max_blocks_per_seq: int):
        self.model, self.kv_caches, self.backend, self.device = model, kv_caches, backend, device
        self.buckets = decode_buckets(max_num_seqs)
        n = self.buckets[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.capture_time_s = 0.0
        self.memory_bytes = 0

    def _metadata(self, b: int) -> AttentionMetadata:
        width = self.block_tables.shape[1]
        bs = self.kv_caches[0][0].shape[1]
        return AttentionMetadata(self.slot_mapping[:b], self.query_start_loc[:b + 1], self.seq_lens[:b],
                                 self.block_tables[:b], max_q_len=1, max_seq_len=width * bs,
                                 q_lens_host=[1] * b, seq_lens_host=[1] * b, padded=True)

    def _forward(self, b: int) -> torch.Tensor:
        with forward_context(ForwardContext(self._metadata(b), self.kv_caches, self.backend)):
            hidden = self.model(self.input_ids[:b], self.positions[:b])
        return self.model.compute_logits(hidden, fp32=False)   # the samplers upcast

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b in sorted(self.buckets, reverse=True):
                for _ in range(2):  # warm-up: Triton autotune/compile outside the graph
                    self._forward(b)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    self.logits[b] = self._forward(b)
                self.graphs[b] = g
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_time_s = time.perf_counter() - t0
        self.memory_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        print(f"[blitz] captured {len(self.graphs)} decode CUDA graphs (batch {self.buckets[0]}..{self.buckets[-1]}) "
              f"in {self.capture_time_s:.1f}s, {self.memory_bytes / 2**20:.0f} MiB", file=sys.stderr)

    def can_run(self, n: int) -> bool:
        return 0 < n <= self.buckets[-1] and bool(self.graphs)

    def run(self, packed: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """packed [4, n] int64 on the device: input ids, positions, slots, seq lens;
        block_tables [n, w] int32 on the device. Returns logits [n, V]."""
        n = packed.shape[1]
        b = next(x for x in self.buckets if x >= n)
        self.input_ids[:n].copy_(packed[0])
        self.positions[:n].copy_(packed[1])
        self.slot_mapping[:n].copy_(packed[2])
        self.seq_lens[:n].copy_(packed[3])
        self.block_tables[:n, :block_tables.shape[1]].copy_(block_tables)
        if b > n:
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
        self.graphs[b].replay()
        return self.logits[b][:n]
