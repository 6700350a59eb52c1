"""Per-step metadata of recurrent layers (gated delta nets): which state row each sequence
of the batch reads and writes, and the state tensors, set by the model runner through a
scoped context beside the attention's ``forward_context`` (same rules: it cannot nest and
is always cleared). Nothing here knows about requests or how rows are handed out.

A row holds one sequence's state after the tokens it has consumed; a sequence whose
``has_initial`` is false starts from zeros (its first tokens), and every layer writes the
state after its tokens back into the row (a pure-decode round may write another row instead:
the runner's look-ahead step, which leaves the states it read as they were).

A step runs in one round, or in several when the state must be kept at points inside a
sequence's tokens (a prefix-cache snapshot at a block boundary, a verify step's every
position): round r takes each sequence's r-th segment, and after it the layer copies the
listed rows elsewhere (``saves``) before the next round continues from them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class StateRound:
    slots: torch.Tensor         # [N] int32 on the device: each sequence's state row
    has_initial: torch.Tensor   # [N] bool: the row holds the state of the tokens before this round's
    cu_seqlens: torch.Tensor    # [N + 1] int32: offsets of the sequences' tokens (in ``rows`` order)
    pure_decode: bool           # one token per sequence (the decode kernels; no host lists needed)
    host: Optional[tuple] = None  # (slots, has_initial, cu_seqlens) as host lists: the torch prefill path
    rows: Optional[torch.Tensor] = None   # [T_r] int64: the step's token rows of this round (None: all, in order)
    saves: Optional[tuple] = None         # (src rows, dst rows) int64: state copies after this round
    dst: Optional[torch.Tensor] = None    # [N] int32: the rows a pure-decode round writes (None: ``slots``)


@dataclass
class StateMetadata:
    caches: dict                # layer index -> (conv_state [R, K - 1, C], ssm_state [R, Hv, dk, dv] fp32)
    rounds: list = field(default_factory=list)

    @classmethod
    def single(cls, caches: dict, slots, has_initial, cu_seqlens, pure_decode: bool, host=None,
               dst=None) -> "StateMetadata":
        """One round over every token of the step."""
        return cls(caches, [StateRound(slots, has_initial, cu_seqlens, pure_decode, host, dst=dst)])


@dataclass
class StatePlan:
    """What a step does with the state rows (host lists, from the engine's state manager)."""
    slots: list                 # per scheduled sequence: its state row
    restores: list = field(default_factory=list)  # (src row, dst row): copies before the step
    splits: list = field(default_factory=list)    # per sequence: [(position p, dst row)], start < p < end:
    #                                               the state after p tokens kept in dst (its own round)
    saves: list = field(default_factory=list)     # (row, dst row): copies after the step


_CURRENT: list = []


@contextlib.contextmanager
def state_context(md: Optional[StateMetadata]):
    """Scoped per-step state metadata for recurrent layers (None: the model has none)."""
    if _CURRENT:
        raise RuntimeError("state_context cannot nest")
    _CURRENT.append(md)
    try:
        yield md
    finally:
        _CURRENT.clear()


def get_state_context() -> StateMetadata:
    if not _CURRENT or _CURRENT[0] is None:
        raise RuntimeError("a recurrent layer ran outside state_context (the runner sets it for models with "
                           "state layers)")
    return _CURRENT[0]


def copy_rows(caches: dict, src: torch.Tensor, dst: torch.Tensor) -> None:
    """State rows ``src`` copied onto rows ``dst`` in every layer's tensors."""
    for tensors in caches.values():
        for t in tensors:
            t.index_copy_(0, dst, t.index_select(0, src))
