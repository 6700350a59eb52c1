"""Speculative decoding (n-gram and draft model) leaves greedy output unchanged, token for
token, under continuous batching, chunked prefill, prefix caching and preemption; rolls
back the KV of rejected drafts (every block free after a run); keeps consistent counters;
and rejects bad configs with errors that name the field."""
import pytest
import torch

from blitzllm import LLM, SamplingParams
from blitzllm.spec.config import parse_speculative_config
from blitzllm.spec.base import ngram_lookup

from tests.conftest import make_tiny_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A smaller model with the target's vocabulary (different weights)."""
    path = tmp_path_factory.mktemp("tiny-draft")
    make_tiny_checkpoint("llama", path, seed=7, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    return str(path)


def _prompts(n=8, seed=11):
    """Mixed lengths; each repeats a random chunk so prompt lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(2, 24, (1,), generator=g))
        base = torch.randint(1, 320, (L,), generator=g).tolist()
        out.append(base + base[: max(1, L // 2)] + base)
    return out


def _params(n):
    # some requests finish after 1-3 tokens, others run long enough to loop (n-gram hits)
    caps = [1, 80, 2, 60, 3, 80, 17, 50]
    return [SamplingParams(temperature=0, max_tokens=caps[i % len(caps)], ignore_eos=True) for i in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=256, enable_prefix_caching=False)
    prompts = _prompts()
    params = _params(len(prompts))
    return prompts, params, [o.token_ids for o in llm.generate(prompts, params)]


def _spec_configs(target, draft):
    return {
        "ngram": NGRAM,
        "draft": {"method": "draft_model", "num_speculative_tokens": 3, "model": draft},
        "self": {"method": "draft_model", "num_speculative_tokens": 4, "model": target},
    }


def _check_stats(llm, spec):
    s = llm.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    assert s["num_running"] == 0 and s["num_waiting"] == 0
    if "spec_draft_kv_blocks_total" in s:
        assert s["spec_draft_kv_blocks_free"] == s["spec_draft_kv_blocks_total"]
    k = spec["num_speculative_tokens"]
    assert s["spec_synthetic"] is False
    assert 0 <= s["spec_accepted_tokens"] <= s["spec_draft_tokens"]
    assert len(s["spec_acceptance_per_position"]) == k
    assert all(0.0 <= a <= 1.0 for a in s["spec_acceptance_per_position"])
    if s["spec_draft_tokens"]:
        assert 1.0 <= s["spec_mean_acceptance_length"] <= k + 1
    return s


@pytest.mark.parametrize("kind", ["ngram", "draft", "self"])
@pytest.mark.parametrize("variant", ["batch", "chunked", "prefix", "preempt"])
def test_greedy_matches_non_speculative(tiny_llama, small_draft, reference, kind, variant):
    prompts, params, ref = reference
    target = str(tiny_llama[0])
    spec = _spec_configs(target, small_draft)[kind]
    kw = dict(device="cpu", kv_cache_blocks=256, max_num_seqs=4, speculative_config=spec)
    if variant == "chunked":
        kw["max_num_batched_tokens"] = 16
    if variant == "preempt":
        kw.update(kv_cache_blocks=24, block_size=8, max_num_seqs=8, max_model_len=160)
    llm = LLM(target, **kw)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    if variant == "prefix":
        # the same prompts again: full prompt blocks (and accepted-token blocks) are cached
        again = llm.generate(prompts, params)
        assert [o.token_ids for o in again] == ref
        assert llm.stats()["prefix_cache_hit_tokens"] > 0
    s = _check_stats(llm, spec)
    if variant == "preempt":
        assert s["preemptions"] > 0
    assert s["spec_draft_tokens"] > 0 and s["spec_accepted_tokens"] > 0
    if kind == "self":   # the target as its own draft: every greedy draft is accepted
        assert s["spec_accepted_tokens"] == s["spec_draft_tokens"]
        assert all(a == 1.0 for a in s["spec_acceptance_per_position"])


@pytest.mark.parametrize("kind", ["ngram", "self"])
def test_stops_inside_accepted_drafts(tiny_llama, small_draft, reference, kind):
    """A stop token / max_tokens reached in the middle of accepted drafts cuts there."""
    prompts, params, ref = reference
    target = str(tiny_llama[0])
    # stop at a token that first appears a few tokens into each long reference output
    stop_params = []
    for p, r in zip(params, ref):
        tok = r[min(len(r) - 1, 6)]
        stop_params.append(SamplingParams(temperature=0, max_tokens=p.max_tokens, stop_token_ids=[tok],
                                          ignore_eos=True))
    plain = LLM(target, device="cpu", kv_cache_blocks=256, enable_prefix_caching=False)
    want = plain.generate(prompts, stop_params)
    spec = _spec_configs(target, small_draft)[kind]
    llm = LLM(target, device="cpu", kv_cache_blocks=256, speculative_config=spec)
    got = llm.generate(prompts, stop_params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == w.finish_reason
    _check_stats(llm, spec)


def test_sampled_requests_run_and_free_blocks(tiny_llama):
    """Random sampling with speculation: seeded runs are reproducible, blocks all free."""
    target = str(tiny_llama[0])
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": target}
    prompts = _prompts(4)
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=i, ignore_eos=True, logprobs=2)
              for i in range(4)]
    a = LLM(target, device="cpu", kv_cache_blocks=256, speculative_config=spec)
    out1 = a.generate(prompts, params)
    out2 = a.generate(prompts, params)
    assert [o.token_ids for o in out1] == [o.token_ids for o in out2]
    for o in out1:
        assert len(o.token_ids) == 20 and len(o.logprobs) == 20
    _check_stats(a, spec)


def test_synthetic_acceptance_is_labelled(tiny_llama):
    target = str(tiny_llama[0])
    spec = dict(NGRAM, synthetic_acceptance_rate=0.5)
    llm = LLM(target, device="cpu", kv_cache_blocks=256, speculative_config=spec)
    llm.generate(_prompts(3), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    s = llm.stats()
    assert s["spec_synthetic"] is True and s["spec_synthetic_acceptance_rate"] == 0.5
    assert s["spec_draft_tokens"] > 0
    assert 0.2 < s["spec_accepted_tokens"] / s["spec_draft_tokens"] < 0.8
    assert s["kv_blocks_free"] == s["kv_blocks_total"]


def test_ngram_lookup():
    toks = [1, 2, 3, 4, 9, 1, 2, 3]
    assert ngram_lookup(toks, 2, 1, 3) == [4, 9]
    assert ngram_lookup(toks, 5, 1, 3) == [4, 9, 1, 2, 3]
    assert ngram_lookup([5, 6, 7], 3, 1, 3) == []
    assert ngram_lookup([5, 6, 5], 3, 2, 3) == []          # only a 1-gram matches
    assert ngram_lookup([5, 6, 5], 3, 1, 3) == [6, 5]


@pytest.mark.parametrize("cfg,msg", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "EAGLE-3 head folder"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "typo": 1}, "unknown key"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, "only used by methods"),
    ({"method": "ngram", "num_speculative_tokens": 3, "synthetic_acceptance_rate": 1.5},
     "synthetic_acceptance_rate"),
    ('{"method": "ngram", ', "not valid JSON"),
    ("[1, 2]", "must be a dict"),
])
def test_config_errors(cfg, msg):
    with pytest.raises(ValueError, match=msg):
        parse_speculative_config(cfg)


def test_config_json_and_errors_in_engine(tiny_llama, small_draft):
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}')
    assert (c.method, c.k, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 2, 4, 1)
    assert parse_speculative_config(None) is None
    with pytest.raises(ValueError, match="needs a model with MTP layers"):
        LLM(str(tiny_llama[0]), device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    for method, extra in (("eagle3", {"model": "x"}), ("mtp", {})):
        with pytest.raises(ValueError, match="tensor_parallel_size 1 only"):
            LLM(str(tiny_llama[0]), device="cpu", tensor_parallel_size=2,
                speculative_config={"method": method, "num_speculative_tokens": 2, **extra})
    with pytest.raises(ValueError, match="not an EAGLE-3 head folder"):
        LLM(str(tiny_llama[0]), device="cpu", speculative_config={"method": "eagle3", "num_speculative_tokens": 2,
                                                                   "model": str(tiny_llama[0])})


def test_draft_vocab_must_match(tiny_llama, tmp_path):
    make_tiny_checkpoint("llama", tmp_path, vocab_size=256, hidden_size=32, num_hidden_layers=1)
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(str(tiny_llama[0]), device="cpu",
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": str(tmp_path)})


def test_cli_bad_config_is_one_line(capsys):
    from blitzllm.cli import main
    code = main(["generate", "--prompt", "hi", "--speculative-config", '{"method": "mtp", '
                 '"num_speculative_tokens": 2}'])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "needs a model with MTP layers" in err


def test_matching_verifier_reproduces_sampling(tiny_llama, reference, monkeypatch):
    """The fallback verifier (accept while the draft equals what the target's own sampler
    draws at that position) gives exactly the non-speculative tokens, sampled or greedy."""
    from blitzllm.spec import verify as verify_mod
    monkeypatch.setattr(verify_mod, "_rs", None)
    prompts, _, _ = reference
    target = str(tiny_llama[0])
    params = [SamplingParams(temperature=0.9 if i % 2 else 0.0, top_k=40, max_tokens=30, seed=100 + i,
                             ignore_eos=True, frequency_penalty=0.1 * (i % 3)) for i in range(len(prompts))]
    want = LLM(target, device="cpu", kv_cache_blocks=256).generate(prompts, params)
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": target}
    llm = LLM(target, device="cpu", kv_cache_blocks=256, max_num_seqs=3, speculative_config=spec)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    s = _check_stats(llm, spec)
    assert s["spec_accepted_tokens"] > 0


def test_server_metrics_expose_spec_counters(tiny_llama):
    from blitzllm.server.metrics import ServerMetrics
    llm = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=64,
              speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": str(tiny_llama[0])})
    llm.generate(_prompts(2), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    s = llm.stats()
    text = ServerMetrics("m", llm.stats).render().decode()
    assert f'blitz_spec_draft_tokens_total{{model_name="m"}} {float(s["spec_draft_tokens"])}' in text
    assert f'blitz_spec_accepted_tokens_total{{model_name="m"}} {float(s["spec_accepted_tokens"])}' in text
    assert 'blitz_spec_synthetic{model_name="m"} 0.0' in text


def test_bench_latency_prints_spec_counters(tiny_llama, capsys):
    from blitzllm.cli import main
    code = main(["bench", "latency", "--model", str(tiny_llama[0]), "--device", "cpu", "--input-len", "8",
                 "--output-len", "12", "--compare", "nospec", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 3, "synthetic_acceptance_rate": 0.9}'])
    out = capsys.readouterr().out
    assert code == 0
    lines = dict(line.split(None, 1) for line in out.strip().splitlines())
    # the same engine without speculation, timed in the same run, and the ratio to it
    nospec = float(lines["nospec_tokens_per_s"])
    assert nospec > 0
    assert abs(float(lines["speedup_vs_nospec"]) - float(lines["tokens_per_s"]) / nospec) < 1e-3 * float(
        lines["speedup_vs_nospec"]) + 1e-3
    assert lines["spec_synthetic"].strip() == "True" and lines["spec_synthetic_acceptance_rate"].strip() == "0.9"
    assert float(lines["spec_mean_acceptance_length"]) >= 1.0
    assert len(lines["spec_acceptance_per_position"].split()) == 3


def test_bench_compare_nospec_needs_spec(tiny_llama, capsys):
    from blitzllm.cli import main
    code = main(["bench", "latency", "--model", str(tiny_llama[0]), "--device", "cpu", "--compare", "nospec"])
    assert code == 2 and "--compare nospec needs --speculative-config" in capsys.readouterr().err


def test_sampled_self_draft_is_accepted(tiny_llama):
    """A draft model samples random requests from its own processed distribution q and
    hands q to the rejection sampler; with the target as its own draft q == p, so (up to
    rounding) every draft is accepted at any temperature / top-p."""
    target = str(tiny_llama[0])
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": target}
    llm = LLM(target, device="cpu", kv_cache_blocks=256, speculative_config=spec)
    params = [SamplingParams(temperature=t, top_p=tp, max_tokens=24, seed=5 + i, ignore_eos=True)
              for i, (t, tp) in enumerate([(1.0, 1.0), (0.7, 0.8), (1.3, 0.95), (0.0, 1.0)])]
    outs = llm.generate(_prompts(4), params)
    assert all(len(o.token_ids) == 24 for o in outs)
    s = _check_stats(llm, spec)
    assert s["spec_accepted_tokens"] >= 0.95 * s["spec_draft_tokens"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("synthetic", [None, 0.5])
def test_greedy_verify_fast_path_equals_rejection_sampler(dtype, synthetic):
    """Plain-greedy rows take the one-launch verify path; it emits the tokens, acceptance
    and logprobs of the general rejection sampler (drafts that match the argmax for a
    while, then differ; a row without drafts; synthetic acceptance)."""
    from blitzllm.layers.sampler import SamplingRow
    from blitzllm.spec import verify as verify_mod
    g = torch.Generator().manual_seed(3)
    V = 97
    lens = [3, 0, 2, 4]
    logits = torch.randn(sum(lens) + len(lens), V, generator=g).to(dtype)
    top = logits.float().argmax(-1).tolist()
    drafts, base = [], 0
    for b, n in enumerate(lens):
        match = [2, 0, 0, 4][b]  # leading drafts equal to the argmax
        drafts.append([top[base + i] if i < match else (top[base + i] + 1) % V for i in range(n)])
        base += n + 1
    rows = [SamplingRow(params=SamplingParams(temperature=0, max_tokens=50), seed=40 + b, prompt_ids=[1, 2],
                        output_ids=list(range(5 + b)), eos_token_id=0) for b in range(len(lens))]
    assert verify_mod._plain_greedy(rows, drafts)
    fast = verify_mod._greedy_verify(logits, rows, drafts, synthetic)
    ref = verify_mod._rejection(logits, rows, drafts, V, "cpu", synthetic, None)
    assert [v.tokens for v in fast] == [v.tokens for v in ref]
    assert [v.num_accepted for v in fast] == [v.num_accepted for v in ref]
    if synthetic is None:
        assert [v.num_accepted for v in fast] == [2, 0, 0, 4]
    else:  # some accepted drafts differ from the argmax: their own logprobs are reported
        assert any(t != top[sum(lens[:b]) + b + i] for b, v in enumerate(fast) for i, t in enumerate(v.tokens))
    for f, r in zip(fast, ref):
        assert f.top is None and r.top is None
        assert f.logprobs == pytest.approx(r.logprobs, abs=1e-5)


def test_greedy_verify_fast_path_only_for_plain_greedy():
    from blitzllm.layers.sampler import SamplingRow
    from blitzllm.spec import verify as verify_mod

    def row(**kw):
        return [SamplingRow(params=SamplingParams(**kw), seed=1, prompt_ids=[1], output_ids=[3, 4], eos_token_id=0)]
    assert verify_mod._plain_greedy(row(temperature=0), [[5]])
    for kw in (dict(temperature=0.7), dict(temperature=0, logprobs=2), dict(temperature=0, presence_penalty=0.5),
               dict(temperature=0, repetition_penalty=1.2), dict(temperature=0, min_tokens=5)):
        assert not verify_mod._plain_greedy(row(**kw), [[5]]), kw


def test_token_bytes_match_is_ngram_match():
    """The proposer's byte-search match equals the Python scan on growing sequences, also
    where a byte pattern occurs across token boundaries (ids whose bytes shift into each
    other: 1, 256, 65536, 2**24) and with prompt / output splits that move."""
    from blitzllm.spec.base import ngram_match
    from blitzllm.spec.proposers import TokenBytes
    g = torch.Generator().manual_seed(5)
    for vocab in ([1, 256, 65536, 1 << 24, 0], [3, 4, 5], list(range(40))):
        for trial in range(20):
            toks = [vocab[i] for i in torch.randint(0, len(vocab), (60,), generator=g).tolist()]
            p = int(torch.randint(1, 20, (1,), generator=g))
            idx = TokenBytes()
            for L in range(p, len(toks) + 1):
                idx.update(toks[:p], toks[p:L])
                for n_min, n_max in ((1, 3), (2, 4), (1, 1), (3, 5)):
                    i, n = idx.match(n_min, n_max)
                    assert (i, n) == ngram_match(toks[:L], n_min, n_max), (vocab, toks[:L], n_min, n_max)
                    if n:
                        assert idx.tokens(i + n, i + n + 3) == toks[i + n:min(i + n + 3, L)]
    idx.update([7, 8], [9])   # a shorter (new) sequence starts over
    assert idx.n == 3 and idx.tokens(0, 3) == [7, 8, 9]
