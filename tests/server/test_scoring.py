"""Issue 36, finding 4 / acceptance 4: ``logit_bias`` and prompt logprobs.

Prompt logprobs (``SamplingParams.prompt_logprobs``; ``echo`` + ``logprobs`` on /v1/completions,
``max_tokens`` 0 for pure scoring) come from the prefill pass, and equal transformers' own
log-softmax on SmolLM2 within 1e-3: batched with other requests, in chunks, with the prefix
cache cold and hot. ``logit_bias`` is added to the logits before sampling on every path (the
sampler's greedy, random, penalized and masked rows; speculative verification; structured
outputs), checked against the model's own logits plus the bias; logprobs stay the raw model's."""
from __future__ import annotations

import httpx
import pytest
import torch

from blitzllm import LLM, SamplingParams
from server_helpers import check_error

TOL = 1e-3
TEXTS = ["The capital of France is Paris, and the capital of Germany is Berlin. " * 3,
         "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
         "Once upon a time, in a small village by the sea, there lived an old fisherman",
         "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20"]


@pytest.fixture(scope="module")
def hf_model(smollm2_hf):
    return smollm2_hf


@pytest.fixture(scope="module")
def chunked_llm():
    """SmolLM2 with prefill in chunks of at most 40 tokens (every prompt here spans several)."""
    return LLM("smollm2", dtype="float32", device="cpu", max_num_batched_tokens=40, block_size=16)


def hf_lp(model, ids: list) -> torch.Tensor:
    """[len(ids), V]: row p is log p(. | ids[:p + 1]) under transformers."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_prompt_logprobs(plp: list, ids: list, ref: torch.Tensor, k: int) -> None:
    """vLLM's form: None for the first token, then {id: logprob} with the prompt token and the
    top k, each within TOL of the reference."""
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        d, t, row = plp[p], ids[p], ref[p - 1]
        assert t in d and abs(d[t] - row[t].item()) < TOL, (p, d.get(t), row[t].item())
        top = row.topk(k).values if k else row[:0]
        assert len(d) in (k, k + 1), (p, d)
        for tid, lp in d.items():
            assert abs(lp - row[tid].item()) < TOL, (p, tid)
        if k:  # the top k are the reference's top k, up to near ties at the k-th
            others = sorted((v for tid, v in d.items() if tid != t or len(d) == k), reverse=True)[:k]
            assert min(others) >= top[-1].item() - TOL


# ---- prompt logprobs ---------------------------------------------------------------------------
def test_prompt_logprobs_match_transformers_batched_and_chunked(chunked_llm, hf_model):
    llm = chunked_llm
    ids = [llm.engine.tokenize(t) for t in TEXTS]
    params = [SamplingParams(prompt_logprobs=3, temperature=0, max_tokens=3),
              SamplingParams(prompt_logprobs=0, temperature=1.0, seed=5, max_tokens=4),
              SamplingParams(temperature=0, max_tokens=6),                  # no prompt logprobs, same batch
              SamplingParams(prompt_logprobs=5, max_tokens=0)]              # pure scoring
    outs = llm.generate(ids, params)
    for i in (0, 1, 3):
        check_prompt_logprobs(outs[i].prompt_logprobs, ids[i], hf_lp(hf_model, ids[i]), params[i].prompt_logprobs)
    assert outs[2].prompt_logprobs is None
    assert outs[3].token_ids == [] and outs[3].finish_reason == "length"
    # prompt logprobs do not change what is generated
    plain = llm.generate(ids[:2], [p.clone(prompt_logprobs=None) for p in params[:2]])
    assert [o.token_ids for o in plain] == [o.token_ids for o in outs[:2]]
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_prompt_logprobs_with_the_prefix_cache_hot(chunked_llm, hf_model):
    """The prompt's blocks are cached (a plain request ran it first): the prompt logprobs are
    still every position's, recomputed, and equal the cold run's; later plain requests still
    hit the cache."""
    llm = chunked_llm
    ids = llm.engine.tokenize(TEXTS[2] + " who caught a golden fish every morning before dawn.")
    ref = hf_lp(hf_model, ids)
    cold = llm.generate([ids], SamplingParams(prompt_logprobs=2, max_tokens=1, temperature=0))[0]
    check_prompt_logprobs(cold.prompt_logprobs, ids, ref, 2)
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))   # (the cache now holds the prompt)
    hits = llm.stats()["prefix_cache_hit_tokens"]
    hot = llm.generate([ids, ids[:40]], SamplingParams(prompt_logprobs=2, max_tokens=1, temperature=0))
    check_prompt_logprobs(hot[0].prompt_logprobs, ids, ref, 2)
    check_prompt_logprobs(hot[1].prompt_logprobs, ids[:40], ref, 2)
    for a, b in zip(cold.prompt_logprobs[1:], hot[0].prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert hot[0].token_ids == cold.token_ids
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    assert llm.stats()["prefix_cache_hit_tokens"] > hits
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_prompt_logprobs_under_preemption(hf_model):
    """A KV cache too small for the batch: requests are preempted mid-prefill and recomputed
    (the prefix cache serving only positions already scored); the prompt logprobs stay
    transformers' and no block leaks."""
    llm = LLM("smollm2", dtype="float32", device="cpu", max_num_batched_tokens=40, block_size=16, kv_cache_blocks=9)
    ids = [llm.engine.tokenize(t) for t in TEXTS]
    params = [SamplingParams(prompt_logprobs=1, temperature=0, max_tokens=4, ignore_eos=True) for _ in ids]
    params[2] = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(ids, params)
    assert llm.stats()["preemptions"] > 0
    for i in (0, 1, 3):
        check_prompt_logprobs(outs[i].prompt_logprobs, ids[i], hf_lp(hf_model, ids[i]), 1)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_prompt_logprobs_validation():
    for bad in (-1, 1.5, True, "3"):  # (21 and more: the engine's max_logprobs, tests/engine/test_max_logprobs.py)
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=0)   # generates nothing and scores nothing
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0


# ---- logit_bias -------------------------------------------------------------------------------
def test_logit_bias_validation(smollm2_llm):
    for bad in ({-1: 1.0}, {"7": 1.0}, {7: 101.0}, {7: -100.5}, {7: float("nan")}, {True: 1.0}, [1, 2]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    assert SamplingParams(logit_bias={7: 100, 8: -100.0}).logit_bias == {7: 100.0, 8: -100.0}
    with pytest.raises(ValueError, match="logit_bias"):
        smollm2_llm.generate([[1, 2, 3]], SamplingParams(logit_bias={10_000_000: 1.0}))


def test_sampler_applies_logit_bias_as_added_logits():
    """Every row kind of the sampler (greedy, random with top-k/p and min-p, penalties, min_tokens
    bans, a structured mask) samples from logits + bias; reported logprobs are the raw ones."""
    from blitzllm.layers.sampler import Sampler, SamplingMetadata, SamplingRow
    V, g = 300, torch.Generator().manual_seed(0)
    logits = torch.randn(6, V, generator=g) * 3
    bias = {3: 5.0, 17: -100.0, 42: 2.5, 250: 100.0}
    kinds = [dict(temperature=0), dict(temperature=0.8, top_k=20, top_p=0.9), dict(temperature=1.2, min_p=0.05),
             dict(temperature=0, repetition_penalty=1.3, presence_penalty=0.5), dict(temperature=0.7, min_tokens=3),
             dict(temperature=1.0, frequency_penalty=0.4)]
    sampler = Sampler(greedy_kernel=False)
    for b in (bias, {7: -3.0}):
        dense = torch.zeros(V)
        dense[list(b)] = torch.tensor(list(b.values()))

        def rows(with_bias):
            return [SamplingRow(SamplingParams(**k, max_tokens=10, logit_bias=b if with_bias else None, seed=i),
                                seed=1000 + i, prompt_ids=[1, 2, 3, 250], output_ids=[5, 250, 7][: i % 3],
                                eos_token_id=0) for i, k in enumerate(kinds)]

        md_b = SamplingMetadata.build(rows(True), V, "cpu")
        md_0 = SamplingMetadata.build(rows(False), V, "cpu")
        got, want = sampler(logits, md_b), sampler(logits + dense, md_0)
        assert got.token_ids.tolist() == want.token_ids.tolist()
        torch.testing.assert_close(sampler.processed_logits(logits, md_b), sampler.processed_logits(logits + dense, md_0))
        raw = logits.log_softmax(-1)
        torch.testing.assert_close(got.logprobs, raw.gather(1, got.token_ids[:, None]).squeeze(1))
    # all greedy, no logprobs (the fast path): still biased
    md = SamplingMetadata.build([SamplingRow(SamplingParams(temperature=0, logit_bias={9: 100.0}), 1, [1], [], 0)] * 2,
                                V, "cpu")
    assert sampler(logits[:2], md).token_ids.tolist() == [9, 9]


def _teacher_forced(hf_model, prompt, out_ids):
    """[len(out_ids), V]: the logits transformers gives before each generated token."""
    with torch.no_grad():
        return hf_model(torch.tensor([prompt + out_ids])).logits[0, len(prompt) - 1:-1].float()


def test_logit_bias_greedy_and_sampled_against_transformers(smollm2_llm, hf_model):
    llm = smollm2_llm
    prompt = llm.engine.tokenize(TEXTS[2])
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    bias = {base[0]: -100.0, base[2]: -30.0, 11: 4.0}
    from blitzllm.layers.sampler import Sampler, SamplingMetadata, SamplingRow
    dense = torch.zeros(len(llm.tokenizer))
    dense[list(bias)] = torch.tensor(list(bias.values()))
    for params in (SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=bias, logprobs=0),
                   SamplingParams(temperature=0.9, top_k=40, seed=3, max_tokens=8, ignore_eos=True, logit_bias=bias,
                                  logprobs=0)):
        outs = llm.generate([prompt, prompt[:10]], [params, params.clone(logit_bias=None)])  # batched with an unbiased row
        out = outs[0]
        assert base[0] not in out.token_ids
        ref = _teacher_forced(hf_model, prompt, out.token_ids)
        rows = [SamplingRow(params.clone(logit_bias=None), params.seed or 0, prompt, out.token_ids[:i], None)
                for i in range(len(out.token_ids))]
        if params.temperature == 0:
            assert out.token_ids == (ref + dense).argmax(-1).tolist()
        else:   # the engine's own sampler on transformers' logits + the bias, at the same seed and steps
            assert out.token_ids == Sampler()(ref + dense, SamplingMetadata.build(rows, ref.shape[1], "cpu")).token_ids.tolist()
        raw = ref.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor([d[t] for d, t in zip(out.logprobs, out.token_ids)]), raw,
                                   atol=TOL, rtol=0)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_logit_bias_in_speculative_verification(smollm2_llm):
    """An n-gram proposer's drafts are verified against the biased distribution: the outputs equal
    the non-speculative engine's, greedy and seeded."""
    spec = LLM("smollm2", dtype="float32", device="cpu",
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompt = smollm2_llm.engine.tokenize(TEXTS[3])
    forced = smollm2_llm.engine.tokenize(" 21")[-1]
    for params in (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias={forced: 3.0, 16: -5.0}),
                   SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True,
                                  logit_bias={forced: 3.0, 16: -5.0})):
        want = smollm2_llm.generate([prompt], params)[0].token_ids
        assert spec.generate([prompt], params)[0].token_ids == want
    assert spec.stats()["spec_draft_tokens"] > 0
    assert spec.stats()["kv_blocks_free"] == spec.stats()["kv_blocks_total"]


def test_logit_bias_with_structured_output(smollm2_llm):
    """The bias applies inside the grammar's mask: a choice's first token pushed down is never
    taken, and a biased token the grammar forbids stays forbidden."""
    from tests.conftest import needs_xgrammar  # noqa: F401 (xgrammar is in the test extras)
    pytest.importorskip("xgrammar")
    llm = smollm2_llm
    q = llm.apply_chat_template([{"role": "user", "content": "Is the sky blue? Answer yes or no."}])
    so = {"type": "choice", "choices": ["yes", "no"]}
    first = {w: llm.engine.tokenize(w)[0] for w in ("yes", "no")}
    for avoid, want in (("yes", "no"), ("no", "yes")):
        out = llm.generate([q], SamplingParams(temperature=0, max_tokens=4, structured_output=so,
                                                logit_bias={first[avoid]: -100.0, 11: 100.0}))[0]
        assert out.text == want


# ---- the server -------------------------------------------------------------------------------
CMPL = "/v1/completions"


def test_echo_logprobs_score_the_prompt(smol_f32_server, hf_model):
    """echo + logprobs: the prompt's tokens with their logprobs (null for the first) and top
    alternatives, then the generated ones; max_tokens 0 scores the prompt alone."""
    text = TEXTS[0]
    ids = httpx.post(smol_f32_server.url + "/tokenize", json={"prompt": text}).json()["tokens"]
    ref = hf_lp(hf_model, ids)
    for max_tokens in (0, 1):
        r = httpx.post(smol_f32_server.url + CMPL, json={"prompt": text, "echo": True, "logprobs": 2, "max_tokens": max_tokens,
                                                     "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        lp = ch["logprobs"]
        assert ch["text"].startswith(text) and len(lp["tokens"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for p in range(1, len(ids)):
            assert abs(lp["token_logprobs"][p] - ref[p - 1, ids[p]].item()) < TOL
            assert 2 <= len(lp["top_logprobs"][p]) <= 3
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert "".join(lp["tokens"][:len(ids)]) == text
        if max_tokens == 0:
            assert ch["text"] == text and ch["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
    # streamed: the first event carries the echoed prompt with its logprobs
    with httpx.stream("POST", smol_f32_server.url + CMPL, json={"prompt": text, "echo": True, "logprobs": 1,
                                                            "max_tokens": 2, "stream": True}, timeout=120) as r:
        import json
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    first = events[0]["choices"][0]
    assert first["text"] == text and first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) == len(ids)
    check_error(httpx.post(smol_f32_server.url + CMPL, json={"prompt": text, "max_tokens": 0}), 400, "max_tokens")


def test_logit_bias_over_http(smol_server):
    msg = [{"role": "user", "content": "Say something."}]
    forced = httpx.post(smol_server.url + "/tokenize", json={"prompt": " banana", "add_special_tokens": False}).json()["tokens"]
    r = httpx.post(smol_server.url + "/v1/chat/completions", json={"messages": msg, "max_tokens": 3, "temperature": 0,
                                                                  "logit_bias": {str(forced[0]): 100}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == " banana" * 3
    r = httpx.post(smol_server.url + CMPL, json={"prompt": "Hi", "max_tokens": 3, "temperature": 0.7, "seed": 1,
                                                 "logit_bias": {str(forced[0]): 100}}, timeout=60)
    assert r.json()["choices"][0]["text"] == " banana" * 3
    for bad, param in (({"abc": 1}, "logit_bias"), ({"5": 101}, "logit_bias.5"), ({"-3": 1}, "logit_bias"),
                       ({"9" * 5000: 1}, "logit_bias"), ({"\uff15": 1}, "logit_bias"),
                       ({"99999999": 1}, "logit_bias"), ({"5": "high"}, "logit_bias.5")):
        check_error(httpx.post(smol_server.url + CMPL, json={"prompt": "Hi", "max_tokens": 1, "logit_bias": bad}),
                    400, param)
