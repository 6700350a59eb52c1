"""Per-step metadata of recurrent layers (gated delta nets): which state slot each sequence
of the batch reads and writes, and the state tensors, set by the model runner through a
scoped context beside the attention's ``forward_context`` (same rules: it cannot nest and
is always cleared). Nothing here knows about requests or how slots are handed out.

A slot holds one sequence's state after the tokens it has consumed; a sequence whose
``has_initial`` is false starts from zeros (its first tokens), and every GDN layer writes
the state after this step's tokens back into the slot.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class StateMetadata:
    caches: dict                # layer index -> (conv_state [S, K - 1, C], ssm_state [S, Hv, dk, dv] fp32)
    slots: torch.Tensor         # [N] int32 on the device: each sequence's state slot
    has_initial: torch.Tensor   # [N] bool: the slot holds the state of the tokens before this step's
    cu_seqlens: torch.Tensor    # [N + 1] int32: token offsets of the sequences (query_start_loc)
    pure_decode: bool           # one token per sequence (the decode kernels; no host lists needed)
    host: Optional[tuple] = None  # (slots, has_initial, cu_seqlens) as host lists: the torch prefill path


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
