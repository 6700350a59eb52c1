"""Speculative verification by exact rejection sampling, batched on the device: the target's
logits at each request's k draft positions + 1 bonus position -> the accepted draft prefix and
one more token, through the ``Sampler``'s logit pipeline. Knows nothing about proposers, KV
caches or the scheduler (docs/speculative.md).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import Tensor

from blitzllm.layers.sampler import (_GOLDEN, _M32, Sampler, SamplingMetadata, SamplingRow,
                                     _fmix32_, exponential_noise, unit_uniform)

# Salt of the acceptance uniform: the hash_bits mix of token id 2**32 - 1, which no real
# token id reaches, so the uniform never coincides with a token's exponential noise.
_ACCEPT_SALT = 0xFFFFFFFF
_SAMPLER = Sampler()


class _LengthOnly(Sequence):
    """``output_ids`` of a position without penalties or bad words: ``SamplingMetadata.build``
    reads only its length (steps, min_tokens), so the history is not copied."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        raise TypeError("token ids of a penalty-free row are not shipped")


def spec_rows(rows: Sequence[SamplingRow], drafts: Sequence[Sequence[int]]) -> list[SamplingRow]:
    """One ``SamplingRow`` per verified position: request b's row i has history
    output_ids + drafts[b][:i], for i = 0..k_b."""
    if len(rows) != len(drafts):
        raise ValueError(f"drafts must have one list per row ({len(rows)}), got {len(drafts)}")
    out = []
    for r, d in zip(rows, drafts):
        d = list(d)
        check_no_drafts_under_a_grammar(r, d)
        for i in range(len(d) + 1):
            hist = (list(r.output_ids) + d[:i] if r.params.uses_penalties or r.bad_words
                    else _LengthOnly(len(r.output_ids) + i))
            out.append(replace(r, output_ids=hist))
    return out


def check_no_drafts_under_a_grammar(row: SamplingRow, draft) -> None:
    """A structured output's row keeps its matcher (its mask applies to its one position) and
    drafts nothing: a draft position's mask would need the matcher advanced over the drafts."""
    if row.matcher is not None and len(draft):
        raise ValueError("a row with a grammar matcher cannot verify drafts")


def build_spec_metadata(rows: Sequence[SamplingRow], drafts: Sequence[Sequence[int]],
                        vocab_size: int, device, extra_steps: int = 0) -> SamplingMetadata:
    """``SamplingMetadata`` with sum(k_b + 1) rows, one per verified position."""
    return SamplingMetadata.build(spec_rows(rows, drafts), vocab_size, device, extra_steps)


def accept_uniform(seeds: Tensor, steps: Tensor) -> Tensor:
    """[N] float32 in (0, 1): a hash of (seed, step, salt), independent of the token noise."""
    key = _fmix32_((seeds & _M32) ^ _GOLDEN)
    key = _fmix32_(key ^ ((seeds >> 32) & _M32))
    key = _fmix32_(key ^ (steps & _M32))
    salt = _fmix32_(torch.tensor([(_ACCEPT_SALT * _GOLDEN + 0x7F4A7C15) & _M32],
                                 dtype=torch.int64, device=seeds.device))
    return unit_uniform(_fmix32_(key ^ salt))


@dataclass
class RejectionOutput:
    output_tokens: Tensor  # [B, K+1] int64, -1 after the num_accepted + 1 emitted tokens
    num_accepted: Tensor  # [B] int64, accepted drafts (emitted = num_accepted + 1)
    logprobs: Tensor  # [B, K+1] float32 (raw distribution), nan where not emitted
    top_ids: Optional[Tensor]  # [B, K+1, N] int64, N = md.max_num_logprobs
    top_logprobs: Optional[Tensor]  # [B, K+1, N] float32


def _layout(num_drafts: Sequence[int]):
    """Per verified row (host tensors): request index, position, whether it scores a draft."""
    nd = torch.as_tensor(list(num_drafts), dtype=torch.int64)
    req = torch.repeat_interleave(torch.arange(len(nd)), nd + 1)
    start = torch.cumsum(nd + 1, 0) - (nd + 1)
    pos = torch.arange(len(req)) - start[req]
    return req, pos, pos < nd[req]


def rejection_sample(target_logits: Tensor, drafts: Sequence[Sequence[int]],
                     md: SamplingMetadata, draft_probs: Optional[Tensor] = None,
                     synthetic_acceptance_rate: Optional[float] = None) -> RejectionOutput:
    """Verify every request's drafts at once (no host sync, no loop over positions).

    ``drafts[b]``: request b's k_b >= 0 draft ids (K = max k_b); ``md``: ``build_spec_metadata``'s.
    ``target_logits`` [sum(k_b + 1), V]: request b's rows contiguous, in request order, scoring
    drafts[b][0..k_b-1] and then the bonus position. ``draft_probs`` [sum(k_b), V] in the drafts'
    flat order: the processed q each draft was sampled from; ``None``: a deterministic proposer
    (q one-hot at the draft). Request b emits ``output_tokens[b, :num_accepted[b] + 1]``: the
    accepted drafts, then the correction (first rejection) or bonus token; logprobs / top ids
    follow the Sampler (raw distribution) per slot. ``synthetic_acceptance_rate`` (benchmarks
    only) accepts each draft with that probability: outputs are then not the target's."""
    raw = target_logits.float()
    N, V = raw.shape
    B = len(drafts)
    num_drafts = [len(d) for d in drafts]
    K = max(num_drafts, default=0)
    dev = raw.device
    if N != sum(num_drafts) + B or md.temperature.shape[0] != N:
        raise ValueError(f"target_logits and md need sum(k_b + 1) = {sum(num_drafts) + B} "
                         f"rows, got {N} and {md.temperature.shape[0]}")
    if draft_probs is not None and tuple(draft_probs.shape) != (sum(num_drafts), V):
        raise ValueError(f"draft_probs must be [{sum(num_drafts)}, {V}], "
                         f"got {list(draft_probs.shape)}")
    if synthetic_acceptance_rate is not None and not 0.0 <= synthetic_acceptance_rate <= 1.0:
        raise ValueError(f"synthetic_acceptance_rate must be in [0, 1], "
                         f"got {synthetic_acceptance_rate}")

    req, pos, is_draft = _layout(num_drafts)
    draft_tok = torch.zeros(N, dtype=torch.int64)  # 0 on bonus rows (never emitted there)
    draft_tok[is_draft] = torch.tensor([t for d in drafts for t in d], dtype=torch.int64)
    draft_rows = is_draft.nonzero().squeeze(1)
    req, pos, is_draft, draft_tok, draft_rows = (
        t.to(dev, non_blocking=True) for t in (req, pos, is_draft, draft_tok, draft_rows))

    x = _SAMPLER.processed_logits(raw, md)  # greedy rows: penalized logits
    greedy = md.temperature == 0
    argmax = x.argmax(dim=-1)
    if md.all_greedy:
        accept, token = draft_tok == argmax, argmax
    else:
        p = x.softmax(dim=-1)
        p_x = p.gather(1, draft_tok[:, None]).squeeze(1)
        # Residual max(0, p - q), = p on bonus rows (q = 0 there).
        if draft_probs is None:  # q one-hot: q(x) = 1, residual = p without x
            q_x = is_draft.float()
            resid = p.clone()
            resid[draft_rows, draft_tok[draft_rows]] = 0.0
        else:
            q = torch.zeros_like(p)
            q[draft_rows] = draft_probs.to(dev, torch.float32)
            q_x = q.gather(1, draft_tok[:, None]).squeeze(1)
            resid = (p - q).clamp_(min=0.0)
        accept = accept_uniform(md.seeds, md.steps) * q_x < p_x
        # Back to p where rounding emptied the residual (p == q: rejection is then moot).
        empty = resid.sum(dim=-1, keepdim=True) <= 0
        resid = torch.where(empty, p, resid)
        token = resid.div_(exponential_noise(md.seeds, md.steps, V)).argmax(dim=-1)
        if md.any_greedy:
            accept = torch.where(greedy, draft_tok == argmax, accept)
            token = torch.where(greedy, argmax, token)
    if synthetic_acceptance_rate is not None:
        accept = accept_uniform(md.seeds, md.steps) < synthetic_acceptance_rate

    # Padded [B, K+1] views; accepted prefix length via a cumulative product.
    slot = req * (K + 1) + pos
    acc_pad = torch.zeros(B * (K + 1), dtype=torch.int64, device=dev)
    acc_pad[slot] = (accept & is_draft).long()
    num_accepted = acc_pad.view(B, K + 1).cumprod(dim=1).sum(dim=1)
    n_acc = num_accepted[req]
    emitted = torch.where(pos < n_acc, draft_tok, token)
    keep = pos <= n_acc

    def padded(values: Tensor, fill) -> Tensor:
        """Per verified row [N, ...] -> [B, K+1, ...], ``fill`` in the slots not emitted."""
        buf = values.new_full((B * (K + 1), *values.shape[1:]), fill)
        buf[slot] = torch.where(keep if values.dim() == 1 else keep[:, None], values, fill)
        return buf.view(B, K + 1, *values.shape[1:])

    out = Sampler._output(raw, emitted, md)
    top = out.top_ids is not None
    return RejectionOutput(output_tokens=padded(emitted, -1), num_accepted=num_accepted,
                           logprobs=padded(out.logprobs, float("nan")),
                           top_ids=padded(out.top_ids, -1) if top else None,
                           top_logprobs=padded(out.top_logprobs, float("nan")) if top else None)
