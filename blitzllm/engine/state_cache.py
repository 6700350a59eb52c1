"""The recurrent-state pool of hybrid models (gated delta nets), kept beside the paged KV
cache: bookkeeping only (rows), no tensors; the runner holds per GDN layer a conv state and
an fp32 recurrent state for every row (``runner/state_pool.py``).

Rows: ``[slots | snapshots | spec | spare | scratch]``.

- a slot per running request, taken when the request is admitted (``match_prefix``) and
  given back with its blocks (finish, abort, preemption), so a request without a free slot
  waits like one without blocks;
- snapshots: the state after a whole number of blocks, named by that block's chained hash
  and evicted LRU, so a prompt that shares a prefix with an earlier one starts from the last
  shared block boundary that has a snapshot (its KV blocks and its state); a step takes one
  at the last block boundary its tokens reach (decodes as they complete a block);
- spec: per slot ``k`` rows where a verify step keeps the state after each of its drafts,
  so that a rejection rolls the state back to the last accepted token (``trim``);
- spare rows, never handed out here: the runner's decode look-ahead writes a step's states
  there, so that a look-ahead it drops leaves the sequences' states intact
  (``runner/state_pool.py``); where the runner looks ahead (CUDA graphs on one rank), one a
  sequence up to ``LOOKAHEAD_ROWS``;
- one scratch row that padded rows of a CUDA-graph batch write to.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Optional

from ..config import ModelConfig
from ..layers.state import StatePlan
from .kv_cache import KVCacheManager


# Batches of up to this many sequences look ahead (each spare row costs one state row of every
# GDN layer; a batch of 32 is past where the host's time per step matters most).
LOOKAHEAD_ROWS = 32


@dataclass(frozen=True)
class StateLayout:
    slots: int
    snapshots: int
    spec: int = 0     # rows per slot for a verify step's drafts
    spare: int = 0    # the runner's look-ahead rows

    @property
    def total(self) -> int:
        return self.slots + self.snapshots + self.slots * self.spec + self.spare + 1

    def snapshot_rows(self) -> range:
        return range(self.slots, self.slots + self.snapshots)

    def spec_row(self, slot: int, j: int) -> int:
        return self.slots + self.snapshots + slot * self.spec + j


def state_layout(cfg: ModelConfig, max_num_seqs: int, prefix_caching: bool, spec_k: int = 0,
                 spare: int = 0) -> Optional[StateLayout]:
    """The pool of a model with state layers (None without): a slot per sequence that may
    run, snapshots for prefix caching (twice the slots, 8 to 64), k spec rows per slot, then
    ``spare`` look-ahead rows."""
    if not cfg.state_layers:
        return None
    snaps = min(64, max(8, 2 * max_num_seqs)) if prefix_caching else 0
    return StateLayout(max_num_seqs, snaps, spec_k, spare)


def state_bytes_per_row(cfg: ModelConfig, dtype_bytes: int, tp_size: int = 1) -> int:
    """One row of every GDN layer of one tensor-parallel rank: the conv state (K - 1 inputs
    of its channels, model dtype) and the recurrent state [Hv, dk, dv] in fp32."""
    if not cfg.state_layers:
        return 0
    text = cfg.text_config
    hk, hv = text["linear_num_key_heads"] // tp_size, text["linear_num_value_heads"] // tp_size
    dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
    conv = (text["linear_conv_kernel_dim"] - 1) * (2 * hk * dk + hv * dv) * dtype_bytes
    return len(cfg.state_layers) * (conv + hv * dk * dv * 4)


class HybridKVCacheManager(KVCacheManager):
    """The KV cache manager of a hybrid model: paged blocks for its attention layers and state
    rows for its GDN layers, handed out and given back together (see the module doc)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, layout: StateLayout):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.layout = layout
        self.free_slots = deque(range(layout.slots))
        self.slot_of: dict[str, Optional[int]] = {}   # request id -> its slot (None: none was free)
        self.snaps: OrderedDict[int, int] = OrderedDict()  # block hash -> snapshot row, oldest use first
        self.free_snaps = deque(layout.snapshot_rows())
        self.restores: list = []      # (src, dst) row copies the next step makes first
        self.pending: dict = {}       # request id -> [(position, row)]: snapshots a step takes, named at commit
        self.spec_rows: dict = {}     # request id -> {position: row}: a verify step's kept states
        self.snapshot_hit_tokens = 0

    # ---- admission and release -----------------------------------------------------
    def match_prefix(self, rid: str, tokens, root=None) -> int:
        """Cached blocks up to the last one whose state snapshot exists (restored into the new
        request's slot before its first step); 0 and no slot when every slot is taken."""
        n = super().match_prefix(rid, tokens, root)
        bs = self.block_size
        if not self.free_slots:
            KVCacheManager.trim(self, rid, 0)
            self.hit_tokens -= n
            self.slot_of[rid] = None
            return 0
        slot = self.free_slots.popleft()
        self.slot_of[rid] = slot
        hashes = self.hashes[rid]
        k = n // bs
        while k and hashes[k - 1] not in self.snaps:
            k -= 1
        if k * bs < n:
            KVCacheManager.trim(self, rid, k * bs)
            self.hit_tokens -= n - k * bs
        if k:
            h = hashes[k - 1]
            self.snaps.move_to_end(h)
            self.restores.append((self.snaps[h], slot))
            self.snapshot_hit_tokens += k * bs
        return k * bs

    def allocate(self, rid: str, num_tokens: int) -> bool:
        if rid in self.slot_of and self.slot_of[rid] is None:
            return False  # no state slot: it waits as if the blocks had run out
        return super().allocate(rid, num_tokens)

    def free_request(self, rid: str) -> None:
        super().free_request(rid)
        slot = self.slot_of.pop(rid, None)
        if slot is not None:
            self.free_slots.append(slot)
            self.restores = [(s, d) for s, d in self.restores if d != slot]
        for _, row in self.pending.pop(rid, []):
            self.free_snaps.append(row)
        self.spec_rows.pop(rid, None)

    # ---- a step ----------------------------------------------------------------------
    def plan_states(self, seqs, drafts: Optional[list] = None) -> StatePlan:
        """The state rows of a scheduled step (``seqs``: ScheduledSeq; ``drafts``: a verify
        step's drafts per seq): slots, the pending restores, the snapshots it takes."""
        bs = self.block_size
        plan = StatePlan([self.slot_of[s.req.request_id] for s in seqs], self.restores)
        self.restores = []
        for i, (s, slot) in enumerate(zip(seqs, plan.slots)):
            rid, d = s.req.request_id, (drafts[i] if drafts else [])
            if d:  # keep the state after each position but the last (the slot has that one)
                rows = {s.end + j: self.layout.spec_row(slot, j) for j in range(len(d))}
                self.spec_rows[rid] = rows
                plan.splits.append(sorted(rows.items()))
                continue
            plan.splits.append([])
            p = s.end // bs * bs
            if not (self.enable_prefix_caching and p > s.start):
                continue
            row = self._snapshot_row()
            if row is None:
                continue
            self.pending.setdefault(rid, []).append((p, row))
            if p == s.end:
                plan.saves.append((slot, row))
            else:
                plan.splits[-1].append((p, row))
        return plan

    def _snapshot_row(self) -> Optional[int]:
        if self.free_snaps:
            return self.free_snaps.popleft()
        if self.snaps:
            return self.snaps.popitem(last=False)[1]  # the least recently used snapshot
        return None

    def commit(self, rid: str, tokens, num_computed: int, root=None) -> None:
        """Block hashes as the base class; snapshots the step took get the hash of their
        block (or go back, when that prefix has one already)."""
        super().commit(rid, tokens, num_computed, root)
        hashes = self.hashes.get(rid, [])
        for p, row in self.pending.pop(rid, []):
            h = hashes[p // self.block_size - 1] if p <= num_computed and p // self.block_size <= len(hashes) else None
            if h is None or h in self.snaps:
                self.free_snaps.append(row)
            else:
                self.snaps[h] = row

    def trim(self, rid: str, num_tokens: int) -> None:
        """Roll back rejected drafts: the KV as the base class, the state from the row that
        kept it after ``num_tokens`` tokens (none when every draft was accepted)."""
        rows = self.spec_rows.pop(rid, None)
        if rows and num_tokens in rows and self.slot_of.get(rid) is not None:
            self.restores.append((rows[num_tokens], self.slot_of[rid]))
        super().trim(rid, num_tokens)

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        self.free_snaps.extend(self.snaps.values())
        self.snaps.clear()

    def state_stats(self) -> dict:
        return {"state_slots_total": self.layout.slots, "state_slots_free": len(self.free_slots),
                "state_snapshots_total": self.layout.snapshots, "state_snapshots_cached": len(self.snaps),
                "state_snapshot_hit_tokens": self.snapshot_hit_tokens}
