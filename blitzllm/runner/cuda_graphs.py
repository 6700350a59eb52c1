"""CUDA graphs for pure-decode steps: one graph per batch-size bucket (1, 2, 4, 8, ...),
captured at start-up, largest first, from one shared memory pool. A step's batch is padded
to the next bucket (padding rows write nothing and read one cached token).

Each graph covers the model forward and the lm_head; sampling runs after it. A hybrid model's
state layers read and write the rows in a device buffer of the graphs (padding rows: the pool's
scratch row). With LoRA, each row's adapter slot is one more input row (-1: none), which the LoRA
products read inside the graph (``blitzllm/lora/manager.py``).
"""
from __future__ import annotations

import sys
import time

import torch

from ..layers.attention import AttentionMetadata, ForwardContext, forward_context
from ..layers.state import state_context

STAGING_SLOTS = 3  # pinned input slots in turn: a step and its look-ahead are in flight at once
# Against fresh pinned tensors per step, three transfers and a copy kernel per input buffer
# (the path before): qwen3-0.6b batch 1 1228.9 / 1229.8 vs 1218.5 / 1218.1 tok/s, kernels per
# layer 7.143 vs 7.179 (H200, scripts/gpu_session.sh stage, since removed)


def decode_buckets(max_num_seqs: int) -> list[int]:
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    out.append(max_num_seqs)
    return out


class DecodeGraphs:
    def __init__(self, model, kv_caches, backend, device, max_num_seqs: int, max_blocks_per_seq: int, states=None,
                 lora=None):
        """``states``: the runner's StatePool of a hybrid model (None: no state layers);
        ``lora``: the LoRA manager (None: no adapters)."""
        self.model, self.kv_caches, self.backend, self.device = model, kv_caches, backend, device
        self.states, self.lora = states, lora
        self.buckets = decode_buckets(max_num_seqs)
        n, w = self.buckets[-1], max_blocks_per_seq
        # The graphs' inputs live in two device buffers, so a step's host data lands with two
        # copies from one pinned staging slot (``run``): [ids; positions; slots (; LoRA slots)]
        # int64 and [seq lens, block tables] int32
        self._in64 = torch.zeros(3 + (lora is not None), n, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping = self._in64[:3]
        self._in64[2:].fill_(-1)
        self._in32 = torch.zeros(n + n * w, dtype=torch.int32, device=device)
        self.seq_lens, self.block_tables = self._in32[:n], self._in32[n:].view(n, w)
        self.seq_lens.fill_(1)
        self._staging: list = []  # pinned host slots (allocated on first use), each with its event
        self._next_slot = 0
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        if states is not None:
            # [rows read; rows written]: the same but in a look-ahead step (state_pool.py)
            self.state_rows = torch.full((2, n), states.scratch, dtype=torch.int32, device=device)
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
        smd = None
        if self.states is not None:
            smd = self.states.decode_metadata(self.state_rows[0, :b], self.state_rows[1, :b], self.query_start_loc[:b + 1])
        lora = self.lora.rows(self._in64[3, :b]) if self.lora is not None else None
        with (forward_context(ForwardContext(self._metadata(b), self.kv_caches, self.backend, lora=lora)),
              state_context(smd)):
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

    def _slot(self):
        """The next pinned staging slot, once the copy that last read it has run."""
        if not self._staging:
            size32 = self._in32.numel()
            for _ in range(STAGING_SLOTS):
                h64 = torch.zeros(self._in64.shape, dtype=torch.int64).pin_memory()
                h32 = torch.zeros(size32, dtype=torch.int32).pin_memory()
                self._staging.append((h64, h32, h64.numpy(), h32.numpy(), torch.cuda.Event()))
        slot = self._staging[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self._staging)
        slot[4].synchronize()
        return slot

    def run(self, ids, pos: list, slots: list, lens: list, block_tables: list, state_rows: list = None,
            state_dst: list = None, lora_slots: list = None) -> torch.Tensor:
        """One decode step of ``len(pos)`` rows: ``ids`` a host list or a device tensor (the
        previous step's sampled tokens), the other inputs host lists. The host data goes
        through a pinned slot with two copies (and one device copy for device ids); rows
        past n up to the bucket are padding (slot -1: they write nothing; state row: scratch).
        A hybrid model's state layers read ``state_rows`` and write ``state_dst`` (default: the
        same rows); with LoRA, ``lora_slots`` are the rows' adapter slots. Returns logits [n, V]."""
        n = len(pos)
        b = next(x for x in self.buckets if x >= n)
        N, w = self._in64.shape[1], self.block_tables.shape[1]
        h64, h32, a64, a32, ev = self._slot()
        if not isinstance(ids, torch.Tensor):
            a64[0, :n] = ids
        a64[1, :n], a64[2, :n], a32[:n] = pos, slots, lens
        a64[:2, n:b], a64[2:, n:b], a32[n:b] = 0, -1, 1
        if self.lora is not None:
            a64[3, :n] = lora_slots
        for i, t in enumerate(block_tables):
            a32[N + i * w:N + i * w + len(t)] = t
        self._in64.copy_(h64, non_blocking=True)
        self._in32[:N + n * w].copy_(h32[:N + n * w], non_blocking=True)
        ev.record()
        if isinstance(ids, torch.Tensor):
            self.input_ids[:n].copy_(ids)
        if self.states is not None:
            pad = [self.states.scratch] * (b - n)
            dst = state_rows if state_dst is None else state_dst
            rows = torch.tensor([list(state_rows) + pad, list(dst) + pad], dtype=torch.int32)
            self.state_rows[:, :b].copy_(rows.pin_memory(), non_blocking=True)
        self.graphs[b].replay()
        return self.logits[b][:n]
