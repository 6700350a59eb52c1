"""Tests for blitzllm.layers.sampler against independent per-row numpy references."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from blitzllm.layers.sampler import (Sampler, SamplingMetadata, SamplingRow, unit_uniform,
                                     exponential_noise, hash_bits)
from blitzllm.sampling_params import SamplingParams

SAMPLER = Sampler()


def row(seed=0, prompt=(), output=(), eos=None, **kw) -> SamplingRow:
    return SamplingRow(params=SamplingParams(**kw), seed=seed, prompt_ids=list(prompt),
                       output_ids=list(output), eos_token_id=eos)


def rand_logits(B, V, seed=0, scale=2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * scale + 0.3


# ------------------------------------------------------------ numpy references
def np_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x[np.isfinite(x)].max())
    e[~np.isfinite(x)] = 0.0
    return e / e.sum()


def ref_penalize(logits, r: SamplingRow, vocab):
    p = r.params
    x = np.array(logits, dtype=np.float64)
    for t in set(r.prompt_ids) | set(r.output_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(r.output_ids).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    if len(r.output_ids) < p.min_tokens:
        for t in ([r.eos_token_id] if r.eos_token_id is not None else []) + p.stop_token_ids:
            if 0 <= t < vocab:
                x[t] = -np.inf
    return x


def ref_processed(logits, r: SamplingRow):
    """Penalties, bans, then temperature -> top-k -> top-p -> min-p, one row at a time."""
    p, V = r.params, len(logits)
    x = ref_penalize(logits, r, V)
    if p.temperature == 0.0:
        return x
    x = x / p.temperature
    if 0 < p.top_k < V:
        kth = sorted(x, reverse=True)[p.top_k - 1]
        x = np.where(x < kth, -np.inf, x)
    if p.top_p < 1.0:
        probs = np_softmax(x)
        keep, total = set(), 0.0
        for i in sorted(range(V), key=lambda i: -probs[i]):
            keep.add(i)
            total += probs[i]
            if total >= p.top_p:
                break
        x = np.array([x[i] if i in keep else -np.inf for i in range(V)])
    if p.min_p > 0.0:
        probs = np_softmax(x)
        x = np.where(probs < p.min_p * probs.max(), -np.inf, x)
    return x


def assert_matches_reference(rows, logits):
    md = SamplingMetadata.build(rows, logits.shape[1], "cpu")
    got = SAMPLER.processed_logits(logits, md)
    assert got.dtype == torch.float32 and got.shape == logits.shape
    for i, r in enumerate(rows):
        want = ref_processed(logits[i].float().numpy(), r)
        g = got[i].numpy()
        np.testing.assert_array_equal(np.isinf(g), np.isinf(want), err_msg=f"row {i} mask")
        fin = np.isfinite(want)
        np.testing.assert_allclose(g[fin], want[fin], rtol=1e-5, atol=1e-5)
    return got


# --------------------------------------------------------------- processing
def test_temperature_top_k_top_p_min_p_match_reference():
    V = 37
    rows = [
        row(temperature=1.0),
        row(temperature=0.5),
        row(temperature=1.7),
        row(temperature=1.0, top_k=1),
        row(temperature=0.8, top_k=5),
        row(temperature=1.0, top_k=-1),
        row(temperature=1.0, top_p=0.3),
        row(temperature=1.3, top_p=0.75),
        row(temperature=1.0, min_p=0.1),
        row(temperature=0.6, min_p=0.5),
        row(temperature=1.2, top_k=10, top_p=0.8, min_p=0.05),
        row(temperature=0.9, top_k=V + 5, top_p=0.95),
    ]
    logits = rand_logits(len(rows), V, seed=1)
    got = assert_matches_reference(rows, logits)
    kept = torch.isfinite(got).sum(-1)
    assert kept[3] == 1 and kept[4] == 5 and kept[0] == V and kept[10] <= 10
    assert 1 <= kept[6] < V and kept[9] < V


@pytest.mark.parametrize("kw", [
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6),
    dict(frequency_penalty=0.7),
    dict(frequency_penalty=-0.5),
    dict(presence_penalty=1.1),
    dict(presence_penalty=-1.5),
    dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3),
])
def test_penalties_match_reference(kw):
    V = 23
    rows = [
        row(prompt=[1, 2, 3, 3], output=[3, 4, 4, 4, 9], temperature=1.0, **kw),
        row(prompt=[0], output=[], temperature=0.7, **kw),
        row(prompt=[5, 6, 7, 8, 10, 11, 12], output=[22, 0, 22], temperature=1.0, **kw),
        row(prompt=[1, 2], output=[1, 2], temperature=1.0),  # no penalties: untouched
        row(prompt=[4], output=[4, 4], temperature=0.0, **kw),  # greedy rows are penalized
    ]
    logits = rand_logits(len(rows), V, seed=2)
    got = assert_matches_reference(rows, logits)
    assert torch.equal(got[3], logits[3])
    # frequency/presence count output tokens only: a prompt-only token is untouched
    if "repetition_penalty" not in kw:
        assert got[0, 1] == logits[0, 1] and got[0, 2] == logits[0, 2]


def test_min_tokens_bans_eos_and_stop_ids():
    V = 19
    rows = [
        row(output=[1], eos=3, min_tokens=2, stop_token_ids=[5, 40], temperature=0.0),
        row(output=[1, 2], eos=3, min_tokens=2, stop_token_ids=[5], temperature=0.0),
        row(output=[], eos=3, min_tokens=1, ignore_eos=True, temperature=1.0, top_p=0.9),
        row(output=[], eos=None, min_tokens=4, stop_token_ids=[7], temperature=0.0),
    ]
    logits = rand_logits(len(rows), V, seed=3)
    logits[:, 3] = 50.0  # EOS would win everywhere
    logits[3, 7] = 60.0
    md = SamplingMetadata.build(rows, V, "cpu")
    assert md.banned_tokens.tolist() == [[3, 5], [-1, -1], [3, -1], [7, -1]]
    got = assert_matches_reference(rows, logits)
    assert torch.isinf(got[0, [3, 5]]).all() and torch.isinf(got[2, 3])
    assert torch.isfinite(got[1]).all()
    toks = SAMPLER(logits, md).token_ids
    assert toks[0] != 3 and toks[1] == 3 and toks[2] != 3
    assert toks[3] == 3  # no EOS for this row: 3 is an ordinary token, only 7 is banned
    assert toks[0] == logits[0].masked_fill(torch.isinf(got[0]), -1e9).argmax()


# ------------------------------------------------------------------- greedy
def test_greedy_is_argmax_and_ignores_top_k_p_min_p():
    V = 41
    rows = [row(temperature=0.0, top_k=3, top_p=0.1, min_p=0.9, seed=s) for s in range(8)]
    logits = rand_logits(8, V, seed=4).to(torch.bfloat16)
    md = SamplingMetadata.build(rows, V, "cpu")
    assert md.all_greedy and md.any_greedy and not md.any_top_k_top_p and not md.any_min_p
    out = SAMPLER(logits, md)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.float().argmax(-1))
    assert torch.equal(SAMPLER.processed_logits(logits, md), logits.float())


def test_greedy_with_penalties_uses_penalized_argmax():
    V = 13
    logits = rand_logits(1, V, seed=5)
    top = int(logits[0].argmax())
    r = row(output=[top] * 3, frequency_penalty=2.0, temperature=0.0)
    out = SAMPLER(logits, SamplingMetadata.build([r], V, "cpu"))
    assert int(out.token_ids[0]) == int(np.argmax(ref_penalize(logits[0].numpy(), r, V)))
    assert int(out.token_ids[0]) != top


def test_mixed_greedy_and_random_batch():
    V = 29
    rows = [row(temperature=0.0 if i % 2 == 0 else 1.0, top_p=0.5, seed=100 + i)
            for i in range(10)]
    logits = rand_logits(10, V, seed=6)
    md = SamplingMetadata.build(rows, V, "cpu")
    assert md.any_greedy and not md.all_greedy
    toks = SAMPLER(logits, md).token_ids
    got = assert_matches_reference(rows, logits)
    for i in range(10):
        if i % 2 == 0:
            assert toks[i] == logits[i].argmax()
        else:
            assert torch.isfinite(got[i, toks[i]])
            alone = SAMPLER(logits[i:i + 1], SamplingMetadata.build([rows[i]], V, "cpu"))
            assert alone.token_ids[0] == toks[i]


# --------------------------------------------------------- seeded randomness
def _py_fmix32(h):
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_hash_matches_plain_integer_spec():
    """The int64 tensor hash (with wrapping multiplies) equals exact Python integers."""
    seeds = [0, 1, 2**32 - 1, 2**32, 123456789012345, 2**63 - 1]
    steps = [0, 7, 2**31, 5, 99999, 3]
    V = 17
    got = hash_bits(torch.tensor(seeds), torch.tensor(steps), V)
    for b, (s, st) in enumerate(zip(seeds, steps)):
        key = _py_fmix32((s & 0xFFFFFFFF) ^ 0x9E3779B9)
        key = _py_fmix32(key ^ (s >> 32))
        key = _py_fmix32(key ^ st)
        for v in range(V):
            tok = _py_fmix32((v * 0x9E3779B9 + 0x7F4A7C15) & 0xFFFFFFFF)
            assert int(got[b, v]) == _py_fmix32(key ^ tok)
    e = exponential_noise(torch.tensor(seeds), torch.tensor(steps), V)
    assert torch.isfinite(e).all() and (e > 0).all()


def test_uniforms_stay_inside_the_unit_interval():
    """Every 32-bit hash value, the extremes and each float32 rounding boundary included, maps
    strictly inside (0, 1), so the Exp(1) noise is never 0 (a token it divides would win over
    every mask) nor inf."""
    top = 2**32 - 1
    bits = torch.tensor([0, 1, 2**9 - 1, 2**31, 2**32 - 2**9, top, top - 2**8, 0xFFFFFF00, 0xFFFFFE80])
    u = unit_uniform(bits)
    assert ((u > 0) & (u < 1)).all(), u
    assert (-u.log() > 0).all() and torch.isfinite(-u.log()).all()


def test_a_sampled_row_never_leaves_its_mask():
    """top_k=1 leaves one token: the sampled token is the argmax even in a row whose hash has its
    top 24 bits all ones at some token (with 24-bit uniforms its noise was 0: 0 / 0 = nan there,
    which argmax took; about one row in 341 at a 49,152-token vocabulary)."""
    V = 49152
    seeds = None
    for start in range(0, 4000, 500):   # the rows whose hash reaches the top at some token
        s = torch.arange(start, start + 500)
        hit = ((hash_bits(s, torch.zeros_like(s), V) >> 8) == 2**24 - 1).any(dim=1)
        if hit.any():
            seeds = s[hit].tolist()
            break
    assert seeds, "no row with a top hash in 4,000 seeds"
    logits = rand_logits(len(seeds), V, seed=3)
    rows = [row(seed=sd, temperature=1.0, top_k=1) for sd in seeds]
    got = SAMPLER(logits, SamplingMetadata.build(rows, V, "cpu")).token_ids
    assert torch.equal(got, logits.argmax(dim=-1))


def test_exponential_noise_moments():
    e = exponential_noise(torch.arange(2000), torch.zeros(2000, dtype=torch.int64), 50)
    assert abs(e.mean().item() - 1.0) < 0.01 and abs(e.var().item() - 1.0) < 0.03


def test_seeded_reproducible_across_calls_and_batches():
    V = 31
    n = 40
    g = torch.Generator().manual_seed(7)
    logits = rand_logits(n, V, seed=7, scale=0.7)  # flat-ish: many plausible tokens
    seeds = torch.randint(0, 2**62, (n,), generator=g).tolist()
    rows = [row(seed=s, output=[1] * (i % 4), temperature=1.0, top_p=0.95) for i, s in
            enumerate(seeds)]
    base = SAMPLER(logits, SamplingMetadata.build(rows, V, "cpu")).token_ids
    again = SAMPLER(logits, SamplingMetadata.build(rows, V, "cpu")).token_ids
    assert torch.equal(base, again)

    # Reverse the order and interleave neighbours with other settings.
    others = [row(seed=9, temperature=0.0), row(seed=3, output=[2, 2], frequency_penalty=1.0,
                                                 repetition_penalty=1.4, temperature=0.8),
              row(seed=4, min_tokens=5, eos=0, temperature=1.5, top_k=4, min_p=0.2)]
    other_logits = rand_logits(3, V, seed=8)
    mixed_rows, mixed_logits, where = [], [], {}
    for j, i in enumerate(reversed(range(n))):
        if j % 3 == 0:
            mixed_rows.append(others[j % 3 if j % 2 else (j // 3) % 3])
            mixed_logits.append(other_logits[(j // 3) % 3])
        where[i] = len(mixed_rows)
        mixed_rows.append(rows[i])
        mixed_logits.append(logits[i])
    mixed = SAMPLER(torch.stack(mixed_logits), SamplingMetadata.build(mixed_rows, V, "cpu"))
    for i in range(n):
        assert mixed.token_ids[where[i]] == base[i]


def test_different_seeds_and_steps_differ():
    V = 50
    logits = rand_logits(1, V, seed=9, scale=0.3).expand(300, V)
    rows = [row(seed=s, temperature=1.0) for s in range(300)]
    toks = SAMPLER(logits, SamplingMetadata.build(rows, V, "cpu")).token_ids
    assert len(set(toks.tolist())) > 35
    rows = [row(seed=42, output=[0] * k, temperature=1.0) for k in range(300)]
    toks = SAMPLER(logits, SamplingMetadata.build(rows, V, "cpu")).token_ids
    assert len(set(toks.tolist())) > 35


def _check_distribution(tokens, probs):
    n = len(tokens)
    counts = np.bincount(tokens, minlength=len(probs)).astype(np.float64)
    assert counts[probs == 0].sum() == 0, "sampled a removed token"
    support = probs > 0
    exp = probs[support] * n
    chi2 = float(((counts[support] - exp) ** 2 / exp).sum())
    df = max(1, int(support.sum()) - 1)
    assert chi2 < df + 6 * math.sqrt(2 * df), (chi2, df)
    assert 0.5 * np.abs(counts / n - probs).sum() < 0.025


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.8),
    dict(temperature=1.4, top_k=8, min_p=0.03),
])
def test_empirical_distribution_over_seeds_and_steps(kw):
    V, n = 16, 20000
    logits = rand_logits(1, V, seed=10, scale=1.5)
    r = row(**kw)
    want = np_softmax(ref_processed(logits[0].numpy(), r))
    md = SamplingMetadata.build([r] * n, V, "cpu")
    processed = SAMPLER.processed_logits(logits.expand(n, V), md)
    np.testing.assert_allclose(torch.softmax(processed[0], -1).numpy(), want, atol=1e-6)

    g = torch.Generator().manual_seed(11)
    md.seeds = torch.randint(0, 2**63 - 1, (n,), generator=g)  # many requests, one step
    _check_distribution(SAMPLER(logits.expand(n, V), md).token_ids.numpy(), want)
    md.seeds = torch.full((n,), 987654321)  # one request over many steps
    md.steps = torch.arange(n)
    _check_distribution(SAMPLER(logits.expand(n, V), md).token_ids.numpy(), want)


# ------------------------------------------------------------------ logprobs
def test_logprobs_are_raw_distribution():
    V = 27
    rows = [row(seed=1, temperature=0.5, top_k=3, frequency_penalty=1.0, output=[2, 2]),
            row(seed=2, temperature=0.0, logprobs=2, min_tokens=3, eos=4),
            row(seed=3, temperature=1.0, top_p=0.5, logprobs=5)]
    logits = rand_logits(3, V, seed=12).to(torch.float16)
    md = SamplingMetadata.build(rows, V, "cpu")
    assert md.max_num_logprobs == 5
    out = SAMPLER(logits, md)
    ref = torch.log_softmax(logits.float().double(), -1)
    assert out.logprobs.dtype == torch.float32 and out.top_logprobs.dtype == torch.float32
    for i in range(3):
        assert abs(out.logprobs[i].item() - ref[i, out.token_ids[i]].item()) < 1e-5
        order = torch.argsort(ref[i], descending=True)[:5]
        assert out.top_ids[i].tolist() == order.tolist()
        np.testing.assert_allclose(out.top_logprobs[i].numpy(), ref[i, order].numpy(),
                                   atol=1e-5)
    none = SAMPLER(logits, SamplingMetadata.build([row(temperature=0.0)] * 3, V, "cpu"))
    assert none.top_ids is None and none.top_logprobs is None and none.logprobs.shape == (3,)


def test_input_logits_not_modified():
    V = 11
    logits = rand_logits(2, V, seed=13)
    before = logits.clone()
    rows = [row(output=[1, 1], repetition_penalty=2.0, min_tokens=5, eos=0, temperature=0.7,
                top_k=4), row(temperature=0.0)]
    md = SamplingMetadata.build(rows, V, "cpu")
    SAMPLER(logits, md)
    SAMPLER.processed_logits(logits, md)
    md = SamplingMetadata.build([row(temperature=0.0)], V, "cpu")
    SAMPLER.processed_logits(logits[:1], md).fill_(0)
    assert torch.equal(logits, before)


# ------------------------------------------------------------------ metadata
def test_build_pads_and_sets_fields():
    V = 20
    rows = [
        row(seed=5, prompt=[1, 2, 3], output=[4], repetition_penalty=1.2, temperature=0.9,
            top_k=50, logprobs=3),
        row(seed=2**63 - 1, prompt=[7] * 6, output=[8, 9, 10], temperature=0.0, top_p=0.2,
            top_k=3, min_p=0.3),
        row(seed=0, prompt=[11], output=[12, 13], frequency_penalty=0.5, top_k=4,
            min_p=0.1),
    ]
    md = SamplingMetadata.build(rows, V, torch.device("cpu"))
    assert md.prompt_tokens.tolist() == [[1, 2, 3], [V] * 3, [V] * 3]  # only rep-penalty rows
    assert md.output_tokens.tolist() == [[4, V], [V, V], [12, 13]]  # only penalty rows
    assert md.prompt_tokens.dtype == md.output_tokens.dtype == torch.int64
    assert md.banned_tokens is None
    assert md.seeds.tolist() == [5, 2**63 - 1, 0] and md.seeds.dtype == torch.int64
    assert md.steps.tolist() == [1, 3, 2]
    assert md.top_k.tolist() == [0, 0, 4]  # k >= V and greedy rows: disabled
    assert md.top_p.tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert md.min_p.tolist() == pytest.approx([0.0, 0.0, 0.1])
    assert md.temperature.dtype == torch.float32
    assert md.temperature.tolist() == pytest.approx([0.9, 0.0, 1.0])
    assert md.repetition_penalty.tolist() == pytest.approx([1.2, 1.0, 1.0])
    assert md.frequency_penalty.tolist() == pytest.approx([0.0, 0.0, 0.5])
    assert md.max_num_logprobs == 3
    assert md.any_greedy and not md.all_greedy and md.any_top_k_top_p and md.any_min_p

    plain = SamplingMetadata.build([row(temperature=0.8), row(temperature=1.0)], V, "cpu")
    assert plain.prompt_tokens is None and plain.output_tokens is None
    assert plain.banned_tokens is None and plain.max_num_logprobs == 0
    assert not plain.any_greedy and not plain.all_greedy
    assert not plain.any_top_k_top_p and not plain.any_min_p

    freq_only = SamplingMetadata.build([row(presence_penalty=0.5, output=[1])], V, "cpu")
    assert freq_only.prompt_tokens is None and freq_only.output_tokens.tolist() == [[1]]
    empty = SamplingMetadata.build([row(presence_penalty=0.5)], V, "cpu")
    assert empty.output_tokens.tolist() == [[V]]
