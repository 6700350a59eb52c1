"""The target's hidden states as draft heads see them (EAGLE-3, MTP): ``HiddenCapture`` records
them with forward hooks during the engine's own forward passes (no engine edits), and
``HiddenStateProposer`` files them per request for a head's proposer to draft from."""
from __future__ import annotations

import torch

from .base import Proposer, common_prefix


class HiddenCapture:
    """Forward hooks on the target's decoder layers ``layer_ids`` (a context manager): every eager
    forward appends features [T, 3 * hidden] (the three layers' x + residual, in the step's flat
    token order; ``final_features``: the final-normed output [T, H]) and positions [T] to
    ``records``. CUDA-graph replays bypass hooks."""

    def __init__(self, model, layer_ids: list, keep_final: bool = False, final_features: bool = False):
        self.model = model
        self.layer_ids = list(layer_ids)
        self.keep_final = keep_final   # also keep the model's output (final-normed hidden states)
        self.final_features = final_features
        self.records: list = []
        self.finals: list = []
        self._cur: dict = {}
        self._positions = None
        self._handles = []

    def __enter__(self) -> "HiddenCapture":
        layers = self.model.model.layers
        for i in sorted(set(self.layer_ids)):
            self._handles.append(layers[i].register_forward_hook(self._layer_hook(i)))
        self._handles.append(self.model.model.register_forward_pre_hook(self._pre_hook))
        self._handles.append(self.model.model.register_forward_hook(self._post_hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _layer_hook(self, i):
        def hook(mod, inp, out):
            x, residual = out
            self._cur[i] = (x + residual if residual is not None else x).detach().float()
        return hook

    def _pre_hook(self, mod, args):
        self._cur = {}
        self._positions = args[1].detach() if len(args) > 1 else None

    def _post_hook(self, mod, args, out):
        feats = out.detach().float() if self.final_features else torch.cat([self._cur[i] for i in self.layer_ids], -1)
        self.records.append((feats, self._positions))
        if self.keep_final:
            self.finals.append(out.detach())
        self._cur = {}

    def take(self) -> tuple:
        """All records since the last take, concatenated: (features [T, 3H], positions [T]);
        with ``keep_final`` also the model outputs [T, H] (their logits are the target's
        next-token distributions) as a third element."""
        recs, self.records = self.records, []
        finals, self.finals = self.finals, []
        if not recs:
            return (None, None, None) if self.keep_final else (None, None)
        feats, pos = torch.cat([f for f, _ in recs]), torch.cat([p for _, p in recs])
        return (feats, pos, torch.cat(finals)) if self.keep_final else (feats, pos)


class HiddenStateProposer(Proposer):
    """The part of a head's proposer that follows the target: its hidden states, filed per request
    as the features and token of every verified position (``toks`` / ``feats``). Subclasses keep
    their own per-request state in ``cache`` and implement ``propose``."""

    def __init__(self, capture: HiddenCapture, runner, kv):
        self.runner, self.kv = runner, kv
        self.cap = capture.__enter__()
        self._segments = []   # per eager forward: [(toks, start, end, block at start)]
        prepare = runner.prepare

        def recording_prepare(seqs, block_tables, positions=None):
            bs = kv.block_size
            # the record this forward's hooks will append is number len(records)
            self._segments.append((len(self.cap.records),
                                   [(list(t), s, e, tab[s // bs] if s // bs < len(tab) else None)
                                    for (t, s, e), tab in zip(seqs, block_tables)]))
            return prepare(seqs, block_tables, positions)
        runner.prepare = recording_prepare
        self.toks: dict = {}    # rid -> input token of each position whose features we hold
        self.feats: dict = {}   # rid -> [m, F] features of those positions
        self.cache: dict = {}   # rid -> the head's own state of those positions
        self.copy_index: dict = {}   # rid -> CopyIndex of its tokens (heads with the copy input)

    def features(self, rid: str, all_ids: list, m: int = 0):
        """The features of positions m..n-1 of a request with tokens ``all_ids`` (n + 1 of
        them: the last has not been through the target yet), or None where they are not all
        held for its tokens (then it drafts nothing)."""
        n = len(all_ids) - 1
        have = self.toks.get(rid, [])
        if n < 1 or len(have) < n or have[m:n] != list(all_ids[m:n]):
            return None
        return self.feats[rid][m:n]

    def reusable(self, rid: str, all_ids: list, n: int) -> int:
        """How many leading positions of the request's ``cache`` entry (its first item: the
        tokens it used, token t + 1 for position t) still agree with ``all_ids``."""
        used = self.cache[rid][0] if rid in self.cache else []
        return common_prefix(used[:n], all_ids[1:n + 1])

    def finish(self, rid: str) -> None:
        for d in (self.toks, self.feats, self.cache, self.copy_index):
            d.pop(rid, None)

    def _ingest(self) -> None:
        """File the features of the forwards since the last call under their requests."""
        recs, segs = self.cap.records, self._segments
        self.cap.records, self._segments = [], []
        owner = {}
        bs = self.kv.block_size
        for rid, tab in self.kv.tables.items():
            for b in tab:
                owner.setdefault(b, []).append(rid)
        for idx, seg in segs:
            if idx >= len(recs) or recs[idx][0].shape[0] != sum(e - s for _, s, e, _ in seg):
                continue   # no (or a different) forward after this prepare: nothing to file
            feats, row = recs[idx][0], 0
            for toks, start, end, blk in seg:
                n = end - start
                for rid in owner.get(blk, ()):
                    if len(self.kv.tables[rid]) > start // bs and self.kv.tables[rid][start // bs] == blk:
                        self._append(rid, start, toks, feats[row:row + n])
                row += n

    def _append(self, rid, start, toks, feats) -> None:
        have = self.toks.get(rid, [])
        if start > len(have):
            return   # a gap: wait for a full re-prefill
        self.toks[rid] = have[:start] + list(toks)
        old = self.feats.get(rid)
        self.feats[rid] = feats if old is None or start == 0 else torch.cat([old[:start], feats])
