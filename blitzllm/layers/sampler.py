"""Turns one step's logits into tokens, the only place blitzllm samples: ``SamplingMetadata.build``
(params -> batched device tensors), the logit pipeline (logit_bias, penalties, bans, temperature, top-k/p,
min-p), greedy and seeded random sampling (an exponential race over a hash of (seed, step,
token id): no RNG state, no host sync, batch-independent) and raw-distribution logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from blitzllm.kernels.greedy import greedy_sample
from blitzllm.sampling_params import SamplingParams

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


# --------------------------------------------------------------------------- noise
def _fmix32_(h: Tensor) -> Tensor:
    """murmur3's 32-bit finalizer, in place, on int64 values in [0, 2**32); the mask after each
    multiply keeps the exact low 32 bits of wrapped products, so CPU and CUDA agree bit for bit."""
    h.bitwise_xor_(h >> 16)
    h.mul_(0x85EBCA6B).bitwise_and_(_M32)
    h.bitwise_xor_(h >> 13)
    h.mul_(0xC2B2AE35).bitwise_and_(_M32)
    h.bitwise_xor_(h >> 16)
    return h


def hash_bits(seeds: Tensor, steps: Tensor, vocab_size: int) -> Tensor:
    """[B, V] int64 in [0, 2**32): a hash of (seeds[b], steps[b], token id v)."""
    key = _fmix32_((seeds & _M32) ^ _GOLDEN)
    key = _fmix32_(key ^ ((seeds >> 32) & _M32))
    key = _fmix32_(key ^ (steps & _M32))
    tok = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    tok = _fmix32_((tok * _GOLDEN + 0x7F4A7C15) & _M32)
    return _fmix32_(key[:, None] ^ tok[None, :])


def unit_uniform(bits: Tensor) -> Tensor:
    """float32 in (0, 1) from int64 hash values in [0, 2**32): the top 23 bits k as (k + 0.5) / 2**23,
    exact in float32. (24 bits are not: k + 0.5 rounds to an integer past 2**23, and 2**24 - 0.5 to
    2**24, a u of 1 whose Exp(1) noise of 0 lets its token win over every mask.)"""
    return (bits >> 9).to(torch.float32).add_(0.5).mul_(1.0 / 2**23)


def exponential_noise(seeds: Tensor, steps: Tensor, vocab_size: int) -> Tensor:
    """[B, V] float32 Exp(1) samples, a pure function of (seed, step, token id); never 0 or inf."""
    return unit_uniform(hash_bits(seeds, steps, vocab_size)).log_().neg_()


# ------------------------------------------------------------------------ metadata
@dataclass
class SamplingRow:
    """Host-side description of one row of the batch."""
    params: SamplingParams
    seed: int  # always set (the engine derives one for unseeded requests); [0, 2**63)
    prompt_ids: list[int]
    output_ids: list[int]  # tokens generated so far by this sequence
    eos_token_id: Optional[int]
    matcher: object = None  # a structured output's grammar matcher (blitzllm/structured.py)
    bad_words: tuple = ()   # params.bad_words as tuples of token ids (the engine tokenizes them)


def _bad_word_bans(words, output_ids) -> list:
    """The tokens that would complete a bad word now: a one-token word's always, a longer word's
    last token where the output ends with the tokens before it."""
    out = []
    for w in words:
        n = len(w) - 1
        if n == 0 or (len(output_ids) >= n and tuple(output_ids[len(output_ids) - n:]) == w[:-1]):
            out.append(w[-1])
    return out


def _pad(lists: list[list], pad, device, dtype: torch.dtype = torch.int64) -> Tensor:
    width = max(1, max(len(x) for x in lists))
    out = torch.full((len(lists), width), pad, dtype=dtype)
    for i, ids in enumerate(lists):
        if ids:
            out[i, :len(ids)] = torch.as_tensor(ids, dtype=dtype)
    return out.to(device, non_blocking=True)


@dataclass
class SamplingMetadata:
    """Device tensors for one step; all [B] unless noted."""
    temperature: Tensor  # float32, 0 = greedy
    top_p: Tensor  # float32 (1 for greedy rows)
    top_k: Tensor  # int64, 0 = disabled (also for greedy rows and k >= V)
    min_p: Tensor  # float32 (0 for greedy rows)
    presence_penalty: Tensor  # float32
    frequency_penalty: Tensor  # float32
    repetition_penalty: Tensor  # float32
    seeds: Tensor  # int64
    steps: Tensor  # int64: len(output_ids), the index of the token being sampled
    prompt_tokens: Optional[Tensor]  # [B, Lp] int64 padded with V; None: no repetition penalty
    output_tokens: Optional[Tensor]  # [B, Lo] int64 padded with V; None: no penalties
    banned_tokens: Optional[Tensor]  # [B, K] int64 padded with -1; None: nothing banned
    max_num_logprobs: int
    all_greedy: bool
    any_greedy: bool
    # Host flags for fast paths; True is always safe (only skips work when False).
    any_top_k_top_p: bool = True
    any_min_p: bool = True
    allowed: Optional[Tensor] = None  # [B, V] bool: structured outputs' next tokens, allowed_token_ids; None: all
    bias_ids: Optional[Tensor] = None     # [B, K] int64: logit_bias token ids (padding: id 0, value 0)
    bias_values: Optional[Tensor] = None  # [B, K] float32: added to those logits; None: no bias

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device, extra_steps: int = 0) -> "SamplingMetadata":
        """``extra_steps``: sample as if each row had that many more output tokens (the
        runner's decode look-ahead; only for rows without penalties)."""
        V = vocab_size
        ps = [r.params for r in rows]
        greedy = [p.temperature == 0.0 for p in ps]
        top_k = [0 if g or p.top_k <= 0 or p.top_k >= V else p.top_k for p, g in zip(ps, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(ps, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(ps, greedy)]
        floats = torch.tensor(
            [[p.temperature for p in ps], top_p, min_p, [p.presence_penalty for p in ps],
             [p.frequency_penalty for p in ps], [p.repetition_penalty for p in ps]],
            dtype=torch.float32).reshape(6, len(rows)).to(device, non_blocking=True)
        ints = torch.tensor(
            [top_k, [r.seed for r in rows], [len(r.output_ids) + extra_steps for r in rows]],
            dtype=torch.int64).reshape(3, len(rows)).to(device, non_blocking=True)

        # Only rows that use a penalty ship their tokens; the others stay all padding.
        prompt_tokens = output_tokens = None
        if any(p.uses_penalties for p in ps):
            output_tokens = _pad([r.output_ids if p.uses_penalties else []
                                  for r, p in zip(rows, ps)], V, device)
            if any(p.repetition_penalty != 1.0 for p in ps):
                prompt_tokens = _pad([r.prompt_ids if p.repetition_penalty != 1.0 else []
                                      for r, p in zip(rows, ps)], V, device)

        bans = []
        for r, p in zip(rows, ps):
            ids = _bad_word_bans(r.bad_words, r.output_ids) if r.bad_words else []
            if len(r.output_ids) + extra_steps < p.min_tokens:
                ids += [] if r.eos_token_id is None else [r.eos_token_id]
                ids += p.stop_token_ids
            bans.append(sorted({t for t in ids if 0 <= t < V}))
        banned_tokens = _pad(bans, -1, device) if any(bans) else None
        bias_ids = bias_values = None
        if any(p.logit_bias for p in ps):
            biases = [list((p.logit_bias or {}).items()) for p in ps]
            bias_ids = _pad([[t for t, _ in b] for b in biases], 0, device)
            bias_values = _pad([[v for _, v in b] for b in biases], 0.0, device, torch.float32)
        allowed = None
        if any(r.matcher is not None for r in rows):
            from ..structured import allowed_mask
            allowed = allowed_mask([r.matcher for r in rows], V, device)
        if any(p.allowed_token_ids for p in ps):
            masks: dict = {}   # one per params (n > 1 and each speculative position share it), by row
            which = []
            for p in ps:
                key = id(p) if p.allowed_token_ids else None
                if key not in masks:
                    if key is None:
                        m = torch.ones(V, dtype=torch.bool)
                    else:
                        ids = torch.tensor(p.allowed_token_ids, dtype=torch.int64)
                        m = torch.zeros(V, dtype=torch.bool).index_fill_(0, ids[ids < V], True)
                    masks[key] = (len(masks), m)
                which.append(masks[key][0])
            only = torch.stack([m for _, m in masks.values()])[torch.tensor(which)]
            only = only.to(device, non_blocking=True)
            if allowed is None:
                allowed = only
            else:   # a grammar none of whose next tokens are allowed wins (as over bad words)
                both = allowed & only
                allowed = torch.where(both.any(dim=-1, keepdim=True), both, allowed)

        return cls(
            temperature=floats[0], top_p=floats[1], min_p=floats[2],
            presence_penalty=floats[3], frequency_penalty=floats[4],
            repetition_penalty=floats[5],
            top_k=ints[0], seeds=ints[1], steps=ints[2],
            prompt_tokens=prompt_tokens, output_tokens=output_tokens,
            banned_tokens=banned_tokens, allowed=allowed, bias_ids=bias_ids, bias_values=bias_values,
            max_num_logprobs=max((p.logprobs or 0 for p in ps), default=0),
            all_greedy=all(greedy), any_greedy=any(greedy),
            any_top_k_top_p=any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p),
            any_min_p=any(m > 0.0 for m in min_p),
        )


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [B] int64
    logprobs: Tensor  # [B] float32, chosen token under log_softmax(raw logits)
    top_ids: Optional[Tensor]  # [B, N] int64, N = max_num_logprobs; raw-distribution top-N
    top_logprobs: Optional[Tensor]  # [B, N] float32


# ------------------------------------------------------------------------- sampler
def _mask_of(tokens: Tensor, vocab_size: int) -> Tensor:
    """[B, V] bool: which ids appear in each row of a V-padded [B, L] token tensor."""
    seen = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.bool, device=tokens.device)
    return seen.scatter_(1, tokens, True)[:, :vocab_size]


def _top_k_top_p(x: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask (-inf) outside top-k (ties with the k-th largest kept), then outside the top-p nucleus
    (the smallest prefix by descending prob reaching top_p: the top token stays). One sort."""
    V = x.shape[-1]
    xs, order = x.sort(dim=-1, descending=True)
    k = torch.where((top_k <= 0) | (top_k > V), V, top_k)
    kth = xs.gather(1, (k - 1)[:, None])
    xs = xs.masked_fill(xs < kth, float("-inf"))
    probs = xs.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = top_p[:, None]
    xs = xs.masked_fill((mass_before >= p) & (p < 1.0), float("-inf"))
    return torch.empty_like(x).scatter_(1, order, xs)


class Sampler(torch.nn.Module):
    """Stateless: everything per-step comes in through ``SamplingMetadata``. ``greedy_kernel``:
    all-greedy steps pick their tokens in one launch, Triton on CUDA and C on an AVX-512 CPU (knob
    ``BLITZ_GREEDY_KERNEL``)."""

    def __init__(self, greedy_kernel: bool = True):
        super().__init__()
        self.greedy_kernel = greedy_kernel

    def forward(self, logits: Tensor, md: SamplingMetadata) -> SamplerOutput:
        if (md.all_greedy and md.max_num_logprobs == 0 and md.output_tokens is None and md.prompt_tokens is None
                and md.banned_tokens is None and md.allowed is None and md.bias_ids is None):
            # argmax + its log-probability of the raw logits: one fused launch on CUDA
            tokens, chosen = greedy_sample(logits, self.greedy_kernel)
            return SamplerOutput(token_ids=tokens, logprobs=chosen, top_ids=None, top_logprobs=None)
        raw = logits.float()
        x = self._penalize(raw, md)
        if md.all_greedy:
            tokens = x.argmax(dim=-1)
        else:
            probs = self._shape(x, md).softmax(dim=-1)
            noise = exponential_noise(md.seeds, md.steps, raw.shape[-1])
            tokens = probs.div_(noise).argmax(dim=-1)
            if md.any_greedy:
                tokens = torch.where(md.temperature == 0, x.argmax(dim=-1), tokens)
        return self._output(raw, tokens, md)

    def processed_logits(self, logits: Tensor, md: SamplingMetadata) -> Tensor:
        """[B, V] float32 logits that random rows sample from (-inf = removed); greedy rows get
        their penalized, banned logits only, whose argmax is the token ``forward`` picks."""
        raw = logits.float()
        x = self._penalize(raw, md)
        if md.all_greedy:
            return x.clone() if x is logits else x
        y = self._shape(x, md)
        if md.any_greedy:
            y = torch.where((md.temperature == 0)[:, None], x, y)
        return y

    # -- pipeline stages ------------------------------------------------------------
    @staticmethod
    def _penalize(x: Tensor, md: SamplingMetadata) -> Tensor:
        """logit_bias (added first, as OpenAI and vLLM do), penalties, bans (min_tokens, bad words)
        and the allowed mask (structured outputs, allowed_token_ids); returns a new tensor when
        anything applies."""
        B, V = x.shape
        if md.bias_ids is not None:
            x = x.scatter_add(1, md.bias_ids, md.bias_values)
        seen = counts = None
        if md.output_tokens is not None:
            out = md.output_tokens
            counts = torch.zeros(B, V + 1, dtype=torch.float32, device=x.device)
            counts = counts.scatter_add_(1, out, torch.ones(out.shape, dtype=torch.float32,
                                                            device=x.device))[:, :V]
            seen = counts > 0
        if md.prompt_tokens is not None:
            in_prompt = _mask_of(md.prompt_tokens, V)
            seen = in_prompt if seen is None else seen | in_prompt
        if seen is not None:
            rp = md.repetition_penalty[:, None]
            x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
        if counts is not None:
            x = (x - md.frequency_penalty[:, None] * counts
                 - md.presence_penalty[:, None] * (counts > 0).float())
        if md.banned_tokens is not None:
            b = md.banned_tokens
            ban = _mask_of(torch.where((b < 0) | (b >= V), V, b), V)
            # a grammar that can only end ends (min_tokens does not hold it open); a row whose
            # allowed tokens are all banned keeps them (some token must come)
            if md.allowed is not None:
                ban &= (md.allowed & ~ban).any(dim=-1, keepdim=True)
            x = x.masked_fill(ban, float("-inf"))
        if md.allowed is not None:
            x = x.masked_fill(~md.allowed, float("-inf"))
        return x

    @staticmethod
    def _shape(x: Tensor, md: SamplingMetadata) -> Tensor:
        """Temperature, top-k, top-p, min-p (greedy rows pass through temperature 1)."""
        t = md.temperature
        x = x / torch.where(t > 0, t, torch.ones_like(t))[:, None]
        if md.any_top_k_top_p:
            x = _top_k_top_p(x, md.top_k, md.top_p)
        if md.any_min_p:
            # p < min_p * p_max  <=>  logit < max_logit + log(min_p); log(0) = -inf keeps all.
            floor = x.amax(dim=-1, keepdim=True) + md.min_p.log()[:, None]
            x = x.masked_fill(x < floor, float("-inf"))
        return x

    @staticmethod
    def _output(raw: Tensor, tokens: Tensor, md: SamplingMetadata) -> SamplerOutput:
        lse = raw.logsumexp(dim=-1)
        chosen = raw.gather(1, tokens[:, None]).squeeze(1) - lse
        top_ids = top_lp = None
        if md.max_num_logprobs > 0:
            vals, top_ids = raw.topk(md.max_num_logprobs, dim=-1)
            top_lp = vals - lse[:, None]
        return SamplerOutput(token_ids=tokens, logprobs=chosen, top_ids=top_ids,
                             top_logprobs=top_lp)
