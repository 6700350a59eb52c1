"""Engine-level distribution test for speculative sampling: a tiny-vocabulary target sampled
through the whole engine with a draft model whose distribution q differs from the target's p
gives the same output distribution as plain sampling (two-sample chi-square per position and
on the joint of two positions), at several temperatures and top-p values."""
from collections import Counter

import pytest
import torch

from blitzllm import LLM, SamplingParams

from tests.conftest import make_tiny_checkpoint

V = 12
DIMS = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, initializer_range=0.6)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target, draft = tmp_path_factory.mktemp("dist-target"), tmp_path_factory.mktemp("dist-draft")
    make_tiny_checkpoint("llama", target, seed=11, **DIMS)
    make_tiny_checkpoint("llama", draft, seed=12, **DIMS)
    return str(target), str(draft)


def two_sample_p(a: Counter, b: Counter) -> float:
    """p-value of the chi-square test that two samples come from one distribution
    (2 x cells contingency table; cells with an expected count below 5 are pooled)."""
    keys = sorted(set(a) | set(b))
    ca = torch.tensor([a[k] for k in keys], dtype=torch.float64)
    cb = torch.tensor([b[k] for k in keys], dtype=torch.float64)
    tot = ca + cb
    na, nb = ca.sum(), cb.sum()
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    big = torch.minimum(ea, eb) >= 5
    obs_a = torch.cat([ca[big], ca[~big].sum()[None]])
    obs_b = torch.cat([cb[big], cb[~big].sum()[None]])
    exp_a = torch.cat([ea[big], ea[~big].sum()[None]])
    exp_b = torch.cat([eb[big], eb[~big].sum()[None]])
    keep = (exp_a > 0) & (exp_b > 0)
    obs_a, obs_b, exp_a, exp_b = obs_a[keep], obs_b[keep], exp_a[keep], exp_b[keep]
    chi2 = float((((obs_a - exp_a) ** 2) / exp_a + ((obs_b - exp_b) ** 2) / exp_b).sum())
    df = len(exp_a) - 1
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(chi2 / 2.0, dtype=torch.float64)))


def test_two_sample_test_detects_a_shift():
    g = torch.Generator().manual_seed(0)
    a = Counter(torch.multinomial(torch.tensor([0.5, 0.3, 0.2]), 800, True, generator=g).tolist())
    b = Counter(torch.multinomial(torch.tensor([0.4, 0.3, 0.3]), 800, True, generator=g).tolist())
    c = Counter(torch.multinomial(torch.tensor([0.5, 0.3, 0.2]), 800, True, generator=g).tolist())
    assert two_sample_p(a, b) < 1e-3 < two_sample_p(a, c)


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.0, 0.8), (1.5, 0.9)])
def test_speculative_sampling_keeps_the_distribution(models, temperature, top_p):
    target, draft = models
    N, prompt = 800, [1, 2, 3]
    params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=4, seed=s, ignore_eos=True)
              for s in range(N)]
    kw = dict(device="cpu", kv_cache_blocks=800, max_num_seqs=256, block_size=16)
    plain = [o.outputs[0].token_ids for o in LLM(target, **kw).generate([prompt] * N, params)]
    spec_llm = LLM(target, speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                               "model": draft}, **kw)
    spec = [o.outputs[0].token_ids for o in spec_llm.generate([prompt] * N, params)]
    s = spec_llm.stats()
    # speculation really ran, with rejections (q != p), and drew differently from plain
    assert s["spec_draft_tokens"] > N and 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"]
    assert sum(a != b for a, b in zip(plain, spec)) >= N // 50
    assert all(len(t) == 4 for t in plain + spec)
    for pos in (1, 2, 3):   # position 0 is sampled at prefill, without drafts
        p = two_sample_p(Counter(t[pos] for t in plain), Counter(t[pos] for t in spec))
        assert p > 1e-3, (pos, p)
    p = two_sample_p(Counter((t[1], t[2]) for t in plain), Counter((t[1], t[2]) for t in spec))
    assert p > 1e-3, ("joint", p)
    assert spec_llm.engine.kv.num_free_blocks == spec_llm.engine.kv.num_blocks
