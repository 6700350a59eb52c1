"""Verification of drafts: the target's logits at each request's k draft positions + the bonus
position -> the tokens it emits, through ``layers/rejection_sampler.py``, the all-greedy fast
path (``_greedy_verify``) or the tests' cross-check (``_match_target``), all exact.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..kernels.greedy import greedy_sample
from ..layers import rejection_sampler as _rs
from ..layers.rejection_sampler import check_no_drafts_under_a_grammar
from ..layers.sampler import Sampler, SamplingMetadata


@dataclass
class Verified:
    tokens: list      # emitted token ids: accepted drafts, then the correction / bonus token
    logprobs: list    # chosen-token logprob per emitted token
    top: Optional[list]   # per emitted token: list of (id, logprob), or None
    num_accepted: int


def _position_rows(rows, drafts) -> list:
    out = []
    for r, d in zip(rows, drafts):
        check_no_drafts_under_a_grammar(r, d)
        for i in range(len(d) + 1):
            out.append(replace(r, output_ids=list(r.output_ids) + list(d[:i])))
    return out


def _synthetic_accept(seed: int, step: int, rate: float) -> bool:
    h = hash((seed, step, 0x5EC0DE)) & 0xFFFFFF
    return (h + 0.5) / 2**24 < rate


def _accepted_prefixes(drafts, accept) -> list:
    """Per request, (its first row among the stacked positions, accepted drafts): drafts
    are taken while ``accept(request, j, row)`` holds, row = first row + j."""
    out, base = [], 0
    for b, d in enumerate(drafts):
        m = 0
        while m < len(d) and accept(b, m, base + m):
            m += 1
        out.append((base, m))
        base += len(d) + 1
    return out


def _match_target(sampler: Sampler, logits, rows, drafts, vocab_size, device, synthetic_rate) -> list:
    md = SamplingMetadata.build(_position_rows(rows, drafts), vocab_size, device)
    out = sampler(logits, md)
    toks, lps = out.token_ids.tolist(), out.logprobs.tolist()
    top = None
    if out.top_ids is not None:
        top = [list(zip(a, b)) for a, b in zip(out.top_ids.tolist(), out.top_logprobs.tolist())]
    if synthetic_rate is not None:
        accept = lambda b, j, row: _synthetic_accept(rows[b].seed, len(rows[b].output_ids) + j, synthetic_rate)  # noqa: E731
    else:
        accept = lambda b, j, row: drafts[b][j] == toks[row]  # noqa: E731
    res = []
    for d, (base, m) in zip(drafts, _accepted_prefixes(drafts, accept)):
        sl = slice(base, base + m + 1)
        res.append(Verified(list(d[:m]) + [toks[base + m]], lps[sl], top[sl] if top is not None else None, m))
    return res


def _plain_greedy(rows, drafts) -> bool:
    """Whether every verified position samples as ``Sampler``'s greedy kernel path: greedy,
    no penalties, no logit_bias, no top logprobs, no grammar, no allowed_token_ids or bad words, and
    past min_tokens (no banned stop tokens)."""
    return all(r.params.temperature == 0.0 and not r.params.logprobs and not r.params.uses_penalties
               and not r.params.logit_bias and r.matcher is None and len(r.output_ids) >= r.params.min_tokens
               and not r.params.allowed_token_ids and not r.bad_words for r in rows)


def _greedy_verify(logits, rows, drafts, synthetic_rate) -> list:
    """All rows plain greedy: a draft is accepted while it equals its position's argmax
    (or, in synthetic mode, while the seeded acceptance uniform is below the rate, as
    ``rejection_sample`` draws it); the emitted logprobs are of the raw distribution."""
    tokens, chosen = greedy_sample(logits)
    if synthetic_rate is not None:  # accepted drafts may differ from the argmax
        dtok = torch.tensor([t for d in drafts for t in list(d) + [0]], dtype=torch.int64)
        g = logits.gather(1, torch.stack([tokens, dtok.to(logits.device, non_blocking=True)], 1)).float()
        lp_draft = (g[:, 1] - g[:, 0] + chosen).tolist()  # log p(draft) = x_d - lse, lse = x_max - lp(argmax)
        seeds = torch.tensor([r.seed for r, d in zip(rows, drafts) for _ in range(len(d) + 1)], dtype=torch.int64)
        steps = torch.tensor([len(r.output_ids) + i for r, d in zip(rows, drafts) for i in range(len(d) + 1)],
                             dtype=torch.int64)
        synth = (_rs.accept_uniform(seeds, steps) < synthetic_rate).tolist()
        accept = lambda b, j, row: synth[row]  # noqa: E731
    toks, lps = tokens.tolist(), chosen.tolist()
    if synthetic_rate is None:   # accepted drafts are the argmax: their logprobs are the chosen ones
        lp_draft = lps
        accept = lambda b, j, row: drafts[b][j] == toks[row]  # noqa: E731
    res = []
    for d, (base, m) in zip(drafts, _accepted_prefixes(drafts, accept)):
        res.append(Verified(list(d[:m]) + [toks[base + m]], lp_draft[base:base + m] + [lps[base + m]], None, m))
    return res


def _rejection(logits, rows, drafts, vocab_size, device, synthetic_rate, draft_probs) -> list:
    md = _rs.build_spec_metadata(rows, drafts, vocab_size, device)
    out = _rs.rejection_sample(logits, drafts, md, draft_probs=draft_probs,
                               synthetic_acceptance_rate=synthetic_rate)
    toks, nacc = out.output_tokens.tolist(), out.num_accepted.tolist()
    lps = out.logprobs.tolist()
    top_ids = out.top_ids.tolist() if out.top_ids is not None else None
    top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    res = []
    for b in range(len(drafts)):
        n = nacc[b] + 1
        top = [list(zip(top_ids[b][i], top_lp[b][i])) for i in range(n)] if top_ids is not None else None
        res.append(Verified(toks[b][:n], lps[b][:n], top, nacc[b]))
    return res


@torch.inference_mode()
def verify(sampler: Sampler, logits, rows: list, drafts: list, vocab_size: int, device,
           synthetic_rate: Optional[float] = None, draft_probs=None) -> list:
    """logits: [sum(len(d) + 1), V], each request's rows contiguous (its draft positions,
    then the bonus position). Returns one ``Verified`` per request."""
    if _rs is None:   # (the tests patch the rejection sampler out to run the cross-check)
        return _match_target(sampler, logits, rows, drafts, vocab_size, device, synthetic_rate)
    if _plain_greedy(rows, drafts):  # greedy acceptance ignores draft_probs
        return _greedy_verify(logits, rows, drafts, synthetic_rate)
    return _rejection(logits, rows, drafts, vocab_size, device, synthetic_rate, draft_probs)
