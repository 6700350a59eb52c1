"""Tests for blitzllm.layers.rejection_sampler: exactness, greedy, seeding, synthetic mode.

The statistical tests run speculative generation on a toy Markov "model" over V = 8 tokens
(target logits T[last token], draft distribution Q[last token] deliberately unlike the
target) and compare the emitted tokens with the exact distribution the non-speculative
Sampler would draw from (its own processed logits). Seeds are fixed, so each test is
deterministic. Threshold: chi-square p-value > 1e-4 per check; with ~60 checks a correct
sampler would fail some check for a fresh set of seeds with probability < 1%, while the
power test shows that a wrong rule (all drafts accepted) scores p < 1e-12 at this size.
"""
from __future__ import annotations

import math

import pytest
import torch

from blitzllm.layers.rejection_sampler import (accept_uniform, build_spec_metadata,
                                               rejection_sample, spec_rows)
from blitzllm.layers.sampler import Sampler, SamplingMetadata, SamplingRow
from blitzllm.sampling_params import SamplingParams

SAMPLER = Sampler()
V = 8
TRIALS = 6000


def row(seed=0, prompt=(0,), output=(), eos=None, **kw) -> SamplingRow:
    return SamplingRow(params=SamplingParams(seed=seed, **kw), seed=seed,
                       prompt_ids=list(prompt), output_ids=list(output), eos_token_id=eos)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of counts against probs; zero-probability cells must be
    empty, cells expected below 5 are pooled."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    assert counts[probs == 0].sum() == 0, "a token outside the support was emitted"
    exp = probs * counts.sum()
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big & (probs > 0)].sum()[None]])
    ex = torch.cat([exp[big], exp[~big & (probs > 0)].sum()[None]])
    obs, ex = obs[ex > 0], ex[ex > 0]
    chi2 = float(((obs - ex) ** 2 / ex).sum())
    df = len(ex) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(chi2 / 2.0, dtype=torch.float64)))


# ------------------------------------------------------------- toy Markov model
TABLE_GEN = torch.Generator().manual_seed(7)
T = torch.randn(V, V, generator=TABLE_GEN)  # target logits given the last token
Q = torch.randn(V, V, generator=TABLE_GEN).mul(1.5).softmax(-1)  # draft distribution


def target_probs(params: SamplingParams, prompt: list[int], outputs: list[int]) -> torch.Tensor:
    """The distribution non-speculative sampling draws the next token from."""
    r = SamplingRow(params=params, seed=0, prompt_ids=prompt, output_ids=outputs,
                    eos_token_id=None)
    md = SamplingMetadata.build([r], V, "cpu")
    last = (prompt + outputs)[-1]
    return SAMPLER.processed_logits(T[last][None], md).softmax(-1)[0]


def spec_generate(kw: dict, k: int, one_hot: bool, n_tokens: int = 2, trials: int = TRIALS,
                  synthetic=None, seed0: int = 1000) -> torch.Tensor:
    """[trials, n_tokens] tokens from rounds of draft + verify, all live trials in one batch.

    Drafts: a deterministic proposer (argmax of Q, q one-hot) or samples from Q (q = Q rows).
    """
    gen = torch.Generator().manual_seed(seed0)
    params = SamplingParams(**kw)
    prompt = [3]
    outs: list[list[int]] = [[] for _ in range(trials)]
    while True:
        live = [i for i in range(trials) if len(outs[i]) < n_tokens]
        if not live:
            break
        ctx = [torch.tensor([(prompt + outs[i])[-1] for i in live])]  # context per position
        for _ in range(k):
            q = Q[ctx[-1]]
            ctx.append(q.argmax(-1) if one_hot else torch.multinomial(q, 1, generator=gen)[:, 0])
        ctx = torch.stack(ctx, 1)  # [L, k+1]: last token, then the drafts
        drafts = ctx[:, 1:].tolist()
        rows = [SamplingRow(params=params, seed=seed0 * 7919 + i, prompt_ids=prompt,
                            output_ids=outs[i], eos_token_id=None) for i in live]
        md = build_spec_metadata(rows, drafts, V, "cpu")
        res = rejection_sample(T[ctx.flatten()], drafts, md,
                               draft_probs=None if one_hot else Q[ctx[:, :-1].flatten()],
                               synthetic_acceptance_rate=synthetic)
        for j, i in enumerate(live):
            outs[i].extend(res.output_tokens[j, :int(res.num_accepted[j]) + 1].tolist())
    return torch.tensor([o[:n_tokens] for o in outs])


CONFIGS = [
    dict(temperature=0.5), dict(temperature=1.0), dict(temperature=1.5),
    dict(temperature=0.5, top_p=0.8), dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.5, top_p=0.8), dict(temperature=1.0, top_k=3),
    dict(temperature=1.5, top_k=5, top_p=0.8), dict(temperature=1.0, min_p=0.1),
    dict(temperature=1.0, frequency_penalty=0.7, presence_penalty=0.3,
         repetition_penalty=1.5),
]


@pytest.mark.parametrize("one_hot", [False, True], ids=["q-draft", "one-hot-draft"])
@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_speculative_output_follows_target_distribution(kw, one_hot):
    toks = spec_generate(kw, k=2, one_hot=one_hot)
    params = SamplingParams(**kw)
    p1 = target_probs(params, [3], [])
    # Second token: conditioned on the first (penalties see it as an output token).
    p2 = torch.stack([target_probs(params, [3], [a]) for a in range(V)])
    joint = p1[:, None] * p2
    c1 = torch.bincount(toks[:, 0], minlength=V)
    c2 = torch.bincount(toks[:, 1], minlength=V)
    cj = torch.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V)
    for counts, probs in ((c1, p1), (c2, joint.sum(0)), (cj, joint)):
        assert chi2_pvalue(counts, probs) > 1e-4, (counts, probs * TRIALS)


def test_chi_square_has_power_against_a_wrong_rule():
    # Accepting every draft emits the draft distribution: the test must see that.
    toks = spec_generate(dict(temperature=1.0), k=2, one_hot=False, synthetic=1.0)
    p1 = target_probs(SamplingParams(temperature=1.0), [3], [])
    assert chi2_pvalue(torch.bincount(toks[:, 0], minlength=V), p1) < 1e-12


def test_greedy_accepts_matching_prefix_and_corrects_with_argmax():
    g = torch.Generator().manual_seed(3)
    K, B = 4, 6
    logits = torch.randn(B * (K + 1), 50, generator=g)
    top = logits.argmax(-1).view(B, K + 1)
    drafts, want = [], []
    for b in range(B):  # request b matches the argmax for its first m = b positions
        m = min(b, K)
        d = top[b, :m].tolist() + [(int(top[b, i]) + 1) % 50 for i in range(m, K)]
        drafts.append(d)
        want.append(d[:m] + [int(top[b, m])])
    md = build_spec_metadata([row(seed=b, temperature=0.0) for b in range(B)], drafts, 50, "cpu")
    res = rejection_sample(logits, drafts, md)
    assert res.num_accepted.tolist() == [min(b, K) for b in range(B)]
    for b in range(B):
        n = len(want[b])
        assert res.output_tokens[b, :n].tolist() == want[b]
        assert (res.output_tokens[b, n:] == -1).all()
        assert res.logprobs[b, :n].isfinite().all() and res.logprobs[b, n:].isnan().all()
    lsm = logits.log_softmax(-1).view(B, K + 1, 50)
    # Same rule for greedy rows in a batch with a random row (the mixed path).
    rnd = torch.randn(K + 1, 50, generator=g)
    rows = [row(seed=b, temperature=0.0) for b in range(B)] + [row(seed=9, temperature=1.0)]
    mixed = rejection_sample(torch.cat([logits, rnd]), drafts + [[0] * K],
                             build_spec_metadata(rows, drafts + [[0] * K], 50, "cpu"))
    assert torch.equal(mixed.output_tokens[:B], res.output_tokens)
    assert torch.allclose(res.logprobs[5], lsm[5].gather(1, res.output_tokens[5][:, None])[:, 0])


def test_greedy_penalty_at_a_draft_position_sees_the_accepted_drafts():
    logits = torch.full((3, 8), 0.0)
    logits[:, 3] = 5.0
    logits[:, 4] = 4.0
    r = row(temperature=0.0, presence_penalty=2.0)
    # Position 0 prefers 3; after 3, position 1 prefers 4 (3 drops to 3.0); after 3, 4 the
    # bonus prefers 3 again (4 drops to 2.0).
    for drafts, want, acc in (([3, 3], [3, 4], 1), ([3, 4], [3, 4, 3], 2)):
        md = build_spec_metadata([r], [drafts], 8, "cpu")
        res = rejection_sample(logits, [drafts], md)
        assert res.num_accepted.tolist() == [acc]
        assert res.output_tokens[0, :acc + 1].tolist() == want


def test_spec_rows_history_steps_and_min_tokens():
    rs = spec_rows([row(output=[5], eos=7, min_tokens=3, frequency_penalty=0.5),
                    row(output=[1, 2], eos=7, min_tokens=3)], [[1, 2, 3], []])
    assert [list(r.output_ids) for r in rs[:4]] == [[5], [5, 1], [5, 1, 2], [5, 1, 2, 3]]
    md = build_spec_metadata([row(output=[5], eos=7, min_tokens=3),
                              row(output=[1, 2], eos=7, min_tokens=3)], [[1, 2, 3], []], 8, "cpu")
    assert md.steps.tolist() == [1, 2, 3, 4, 2]
    banned = [7 in b.tolist() for b in md.banned_tokens]
    assert banned == [True, True, False, False, True]


def _batch(reqs):
    """reqs: (SamplingRow, drafts, logits [k+1, V], draft_probs [k, V] or None)."""
    md = build_spec_metadata([r for r, *_ in reqs], [d for _, d, *_ in reqs], V, "cpu")
    qs = [q for *_, q in reqs]
    dp = torch.cat(qs) if all(q is not None for q in qs) else None
    return rejection_sample(torch.cat([lg for _, _, lg, _ in reqs]), [d for _, d, *_ in reqs],
                            md, draft_probs=dp)


def _req(seed, k, temperature=0.9, **kw):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(k, V, generator=g).softmax(-1)
    d = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
    return (row(seed=seed, temperature=temperature, top_p=0.9, output=[1] * (seed % 5), **kw),
            d, torch.randn(k + 1, V, generator=g) * 2, q)


def test_seeded_request_is_reproducible_in_any_batch():
    varied = set()
    for s in range(40):
        me = _req(100 + s, 3)
        alone = _batch([me])
        with_a = _batch([_req(1, 2), me, _req(2, 4, temperature=0.0)])
        with_b = _batch([_req(3, 0), _req(4, 3, temperature=1.3), _req(5, 1), me])
        for out, i in ((with_a, 1), (with_b, 3)):
            assert out.num_accepted[i] == alone.num_accepted[0]
            assert torch.equal(out.output_tokens[i, :4], alone.output_tokens[0])
        varied.add(int(alone.num_accepted[0]))
    assert len(varied) >= 3  # the seeds exercise accepts and rejections


def test_no_drafts_equals_the_plain_sampler():
    g = torch.Generator().manual_seed(9)
    rows = [row(seed=s, temperature=t, top_k=5, logprobs=2, output=[1, 2])
            for s, t in ((1, 0.7), (2, 0.0), (3, 1.2), (4, 1.0))]
    logits = torch.randn(4, V, generator=g)
    plain = SAMPLER(logits, SamplingMetadata.build(rows, V, "cpu"))
    res = rejection_sample(logits, [[]] * 4, build_spec_metadata(rows, [[]] * 4, V, "cpu"))
    assert torch.equal(res.output_tokens[:, 0], plain.token_ids)
    assert torch.equal(res.logprobs[:, 0], plain.logprobs)
    assert torch.equal(res.top_ids[:, 0], plain.top_ids)
    assert res.num_accepted.tolist() == [0] * 4


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.7, 0.9, 1.0])
def test_synthetic_acceptance_rate(rate):
    B, K = 3000, 4
    rows = [row(seed=s, temperature=1.0 if s % 2 else 0.0) for s in range(B)]
    drafts = [[s % V] * K for s in range(B)]
    md = build_spec_metadata(rows, drafts, V, "cpu")
    logits = torch.randn(B * (K + 1), V, generator=torch.Generator().manual_seed(1))
    acc = rejection_sample(logits, drafts, md, synthetic_acceptance_rate=rate).num_accepted
    # Each draft is accepted w.p. rate given the earlier ones: P(num_accepted >= i) = rate**i.
    for i in range(1, K + 1):
        p = rate ** i
        sd = math.sqrt(p * (1 - p) / B)
        assert abs(float((acc >= i).double().mean()) - p) <= 4.5 * sd + 1e-12
    trials = int(acc.sum()) + int((acc < K).sum())  # Bernoulli decisions actually made
    if 0 < rate < 1:
        assert abs(int(acc.sum()) / trials - rate) < 4.5 * math.sqrt(rate * (1 - rate) / trials)


def test_accept_uniform_is_uniform_and_distinct_per_step():
    seeds = torch.arange(20000, dtype=torch.int64) * 1000003
    u = accept_uniform(seeds, torch.full_like(seeds, 5))
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert chi2_pvalue(torch.bincount((u * 10).long(), minlength=10), torch.full((10,), 0.1)) > 1e-4
    assert not torch.equal(u, accept_uniform(seeds, torch.full_like(seeds, 6)))


def test_rejects_bad_shapes():
    md = build_spec_metadata([row(seed=1)], [[1, 2]], V, "cpu")
    with pytest.raises(ValueError, match="sum"):
        rejection_sample(torch.zeros(2, V), [[1, 2]], md)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.zeros(3, V), [[1, 2]], md, draft_probs=torch.zeros(3, V))
    with pytest.raises(ValueError, match="synthetic"):
        rejection_sample(torch.zeros(3, V), [[1, 2]], md, synthetic_acceptance_rate=1.5)
