"""The engine's speculative-decoding companion: asks the proposer for drafts for the
decodes of a scheduled step, reserves their KV slots, verifies the target's scores, rolls
back KV of rejected drafts and keeps the counters. Knows the KV manager's bookkeeping but
not the model or tensors beyond the logits it is handed."""
from __future__ import annotations

from typing import Optional

import torch

from .config import SpeculativeConfig
from .base import Proposer
from .verify import verify


class SpecDecoder:
    def __init__(self, cfg: SpeculativeConfig, proposer: Proposer, kv, max_num_batched_tokens: int):
        """``kv``: the target's KV cache manager (engine/kv_cache.py)."""
        self.cfg = cfg
        self.proposer = proposer
        self.kv = kv
        self.budget = max_num_batched_tokens
        self._probs = None
        self.reset_counters()

    def reset_counters(self) -> None:
        self.drafted = 0
        self.accepted = 0
        self.verify_rows = 0   # request-steps that verified at least one draft
        self.drafted_at = [0] * self.cfg.k
        self.accepted_at = [0] * self.cfg.k

    # ---- before the forward --------------------------------------------------------
    def propose(self, seqs) -> Optional[list]:
        """Drafts per scheduled seq ([] for prefill chunks and non-drafting decodes), with
        their KV slots allocated; None when no seq drafts (the step runs as usual)."""
        k = self.cfg.k
        budget = self.budget - sum(s.num_tokens for s in seqs)
        cand, limits = [], []
        for i, s in enumerate(seqs):
            r = s.req
            if not (s.samples and s.num_tokens == 1) or budget <= 0 or r.params.structured_output is not None:
                continue  # (a structured output's mask follows each token: it drafts nothing)
            lim = min(k, r.max_total_tokens - r.num_tokens - 1, budget)
            if r.params.max_tokens is not None:
                lim = min(lim, r.params.max_tokens - len(r.output_token_ids) - 1)
            if lim <= 0:
                continue
            cand.append(i)
            limits.append(lim)
            budget -= lim
        self._probs = None
        if not cand:
            return None
        prop = self.proposer.propose([seqs[i].req for i in cand], limits)
        drafts = [[] for _ in seqs]
        probs = [None] * len(seqs)
        for j, (i, lim) in enumerate(zip(cand, limits)):
            d = list(prop.drafts[j][:lim])
            if self.cfg.synthetic and len(d) < lim:
                # benchmark mode: always k drafts (their values do not matter there)
                d += [seqs[i].req.all_token_ids[-1]] * (lim - len(d))
            s = seqs[i]
            if d and not self.kv.allocate(s.req.request_id, s.end + len(d)):
                d = []
            drafts[i] = d
            if prop.probs is not None and prop.probs[j] is not None and d:
                probs[i] = prop.probs[j][:len(d)]
        if not any(drafts):
            return None
        if any(p is not None for p in probs):
            self._probs = probs
        return drafts

    # ---- after the forward ---------------------------------------------------------
    def verify(self, sampler, logits, rows, drafts, vocab_size, device) -> list:
        """rows / drafts: per sampling seq. Returns ``Verified`` per sampling seq."""
        dp = None
        if self._probs is not None:
            parts = []
            for d, p in zip(drafts, self._sampled_probs):
                if not d:
                    continue
                if p is None or p.shape[0] != len(d):   # point drafts: q is one-hot
                    p = torch.nn.functional.one_hot(torch.tensor(d, device=device), vocab_size)
                parts.append(p.to(device, torch.float32))
            dp = torch.cat(parts)
        out = verify(sampler, logits, rows, drafts, vocab_size, device,
                     self.cfg.synthetic_acceptance_rate, dp)
        for d, v in zip(drafts, out):
            if not d:
                continue
            self.drafted += len(d)
            self.accepted += v.num_accepted
            self.verify_rows += 1
            for j in range(len(d)):
                self.drafted_at[j] += 1
                self.accepted_at[j] += j < v.num_accepted
        return out

    def select_probs(self, sample_idx: list) -> None:
        """Keep the draft probs of the sampling seqs, in their order."""
        self._sampled_probs = [self._probs[i] for i in sample_idx] if self._probs is not None else None

    def rollback(self, req, end: int, num_accepted: int) -> None:
        """The step computed KV for positions < end + len(drafts); keep the accepted ones
        (end + num_accepted tokens), hand back whole blocks past them, and register
        prefix-cache hashes of newly full blocks of accepted tokens."""
        rid = req.request_id
        req.num_computed_tokens = end + num_accepted
        self.kv.trim(rid, req.num_computed_tokens)
        self.kv.commit(rid, req.hash_tokens, req.num_computed_tokens, req.cache_root)

    def finish(self, rid: str) -> None:
        self.proposer.finish(rid)

    def stats(self) -> dict:
        return {
            "spec_method": self.cfg.method,
            "spec_num_speculative_tokens": self.cfg.k,
            "spec_synthetic": self.cfg.synthetic,
            "spec_synthetic_acceptance_rate": self.cfg.synthetic_acceptance_rate,
            "spec_draft_tokens": self.drafted,
            "spec_accepted_tokens": self.accepted,
            "spec_acceptance_per_position": [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)],
            "spec_mean_acceptance_length": ((self.accepted + self.verify_rows) / self.verify_rows
                                            if self.verify_rows else 0.0),
            **self.proposer.stats(),
        }
