"""The recurrent-state tensors of a hybrid model and each step's state metadata.

Per GDN layer a conv state [rows, K - 1, C] (model dtype) and a recurrent state
[rows, Hv, dk, dv] (fp32); rows as ``engine/state_cache.py`` lays them out (the runner only
knows their count, that the last is scratch and that the ``spare`` rows before it are its own).
A step's ``StatePlan`` (host lists) becomes the copies before it (restores), the
``StateMetadata`` of its forward (one round, or one per segment where a sequence keeps its
state at points inside its tokens) and the copies after it.

Spare rows serve the decode look-ahead (``ModelRunner._decode_step``): it reads each
sequence's state and writes the next one into a spare row, so a dropped look-ahead leaves the
states as they were; when it is kept, the spare rows become the sequences' rows (``take``) and
their old rows spare. Hence an engine row (``plan.slots``) is named through ``phys``, never used
as a tensor index as it is.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..layers.state import StateMetadata, StatePlan, StateRound, copy_rows


class StatePool:
    def __init__(self, model, rows: int, dtype: torch.dtype, device: torch.device, spare: int = 0):
        self.device, self.rows = device, rows
        self.phys = list(range(rows))   # engine row -> the tensor row that holds its state now
        self.spare = list(range(rows - 1 - spare, rows - 1))   # free rows of look-ahead steps
        self.caches = {layer.layer_idx: (torch.zeros(rows, *layer.conv_state_shape, dtype=dtype, device=device),
                                         torch.zeros(rows, *layer.ssm_state_shape, dtype=torch.float32, device=device))
                       for layer in model.state_layers()}

    @property
    def scratch(self) -> int:
        return self.rows - 1

    def _dev(self, data, dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def rows_of(self, rows) -> list:
        """Engine rows -> the tensor rows that hold their states."""
        return [self.phys[r] for r in rows]

    def ahead_rows(self, n: int) -> Optional[list]:
        """``n`` spare rows for a look-ahead step to write (None when fewer are free)."""
        if len(self.spare) < n:
            return None
        rows, self.spare = self.spare[:n], self.spare[n:]
        return rows

    def take(self, slots: list, rows: list) -> None:
        """A look-ahead step over engine rows ``slots`` is kept: ``rows`` (where it wrote) now hold
        their states, and the rows it read are spare."""
        for s, r in zip(slots, rows):
            self.spare.append(self.phys[s])
            self.phys[s] = r

    def drop(self, rows: list) -> None:
        """A look-ahead step is dropped: the rows it wrote are spare again."""
        self.spare.extend(rows)

    def copy(self, pairs: list) -> None:
        """(src row, dst row) copies in every layer, in order of the list (engine rows)."""
        if pairs:
            src, dst = zip(*pairs)
            copy_rows(self.caches, self._dev(self.rows_of(src), torch.int64), self._dev(self.rows_of(dst), torch.int64))

    def zero(self, rows: list) -> None:
        """Engine rows of sequences that start now: zero states (the decode kernels read them as
        they are)."""
        if rows:
            idx = self._dev(self.rows_of(rows), torch.int64)
            for tensors in self.caches.values():
                for t in tensors:
                    t.index_fill_(0, idx, 0)

    def begin(self, plan: Optional[StatePlan], seqs, qsl: list, cu_seqlens: torch.Tensor, pure_decode: bool):
        """The restores of ``plan``, then the step's StateMetadata. ``seqs``: (tokens, start,
        end) per sequence; ``qsl``: their token offsets (host), ``cu_seqlens`` the same on the device."""
        if plan is None:
            raise RuntimeError("a model with state layers needs a StatePlan for every step")
        self.copy(plan.restores)
        slots = self.rows_of(plan.slots)
        firsts = [start > 0 for _, start, _ in seqs]
        self.zero([row for row, has in zip(plan.slots, firsts) if not has])
        if not any(plan.splits):
            return StateMetadata.single(self.caches, self._dev(slots, torch.int32), self._dev(firsts, torch.bool),
                                        cu_seqlens, pure_decode, (slots, firsts, qsl))
        # segments of each sequence: [(first row, end row, save row or None)], cut at its split points
        segs = []
        for i, ((_, start, end), cuts) in enumerate(zip(seqs, plan.splits)):
            base, prev, mine = qsl[i] - start, start, []
            for p, row in cuts:
                mine.append((base + prev, base + p, self.phys[row]))
                prev = p
            mine.append((base + prev, base + end, None))
            segs.append(mine)
        rounds = []
        for r in range(max(len(m) for m in segs)):
            who = [i for i, m in enumerate(segs) if len(m) > r]
            part = [segs[i][r] for i in who]
            cu = [0]
            for a, b, _ in part:
                cu.append(cu[-1] + b - a)
            rows = [t for a, b, _ in part for t in range(a, b)]
            rs, fs = [slots[i] for i in who], [firsts[i] if r == 0 else True for i in who]
            saves = [(slots[i], row) for i, (_, _, row) in zip(who, part) if row is not None]
            rounds.append(StateRound(
                self._dev(rs, torch.int32), self._dev(fs, torch.bool), self._dev(cu, torch.int32),
                all(b - a == 1 for a, b, _ in part), (rs, fs, cu), rows=self._dev(rows, torch.int64),
                saves=tuple(self._dev(list(x), torch.int64) for x in zip(*saves)) if saves else None))
        return StateMetadata(self.caches, rounds)

    def finish(self, plan: StatePlan) -> None:
        """The copies after the step (snapshots of states that end on a block boundary)."""
        self.copy(plan.saves)

    def decode_metadata(self, slots: torch.Tensor, dst: torch.Tensor, cu_seqlens: torch.Tensor) -> StateMetadata:
        """A pure-decode step over the tensor rows in the device buffer ``slots``, writing the
        rows in ``dst`` (CUDA graphs)."""
        ones = torch.ones(slots.shape[0], dtype=torch.bool, device=slots.device)
        return StateMetadata.single(self.caches, slots, ones, cu_seqlens, True, dst=dst)
