"""What every proposer shares: the ``Proposer`` interface, its ``Proposal``, and prompt
lookup's n-gram match (the n-gram proposer's rule, which EAGLE-3's copy input reuses)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass
class Proposal:
    drafts: list            # per request: list of draft token ids
    probs: Optional[list] = None   # per request: [len(drafts), V] tensor or None; None: all point drafts


class Proposer:
    """``propose(reqs, limits)``: up to ``limits[i]`` draft ids per request (maybe none) and,
    optionally, the distributions they were sampled from (``probs[i]`` [len(drafts[i]), V], None
    for point drafts); ``finish(rid)`` drops any per-request state. Heads implement the same."""

    def propose(self, reqs: Sequence, limits: Sequence[int]) -> Proposal:
        raise NotImplementedError

    def finish(self, rid: str) -> None:
        pass

    def stats(self) -> dict:
        return {}


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def ngram_match(tokens: Sequence[int], n_min: int, n_max: int) -> tuple:
    """Prompt lookup's match: the longest suffix n-gram (n_max down to n_min) that occurred
    earlier in ``tokens``, as (start of its latest earlier occurrence, n), or (-1, 0)."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = list(tokens[L - n:])
        first = suffix[0]
        for i in range(L - n - 1, -1, -1):
            if tokens[i] == first and list(tokens[i:i + n]) == suffix:
                return i, n
    return -1, 0


def ngram_lookup(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list:
    """Prompt lookup: up to k tokens that followed the latest earlier occurrence of the
    longest suffix n-gram (``ngram_match``)."""
    if k <= 0:
        return []
    i, n = ngram_match(tokens, n_min, n_max)
    return list(tokens[i + n:i + n + k]) if n else []
