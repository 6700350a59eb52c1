"""Continuous batching, chunked prefill, prefix caching and preemption leave greedy output
unchanged, and every run ends with all KV blocks free."""
import pytest
import torch

from blitzllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _prompts(n, seed=3, lo=3, hi=60):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(1, 320, (L,), generator=g).tolist() for L in lens]


def _all_free(llm):
    s = llm.stats()
    return s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_running"] == 0 and s["num_waiting"] == 0


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Each prompt alone, generous budget, no prefix cache."""
    path, _ = tiny_llama
    llm = LLM(str(path), device="cpu", kv_cache_blocks=256, enable_prefix_caching=False)
    prompts = _prompts(10)
    return prompts, [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


def test_continuous_batching(tiny_llama, reference):
    prompts, ref = reference
    llm = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=256, max_num_seqs=4)
    # different max_tokens so requests finish at different steps and new ones join mid-flight
    params = [SamplingParams(temperature=0, max_tokens=10 + (i % 3) * 5, ignore_eos=True) for i in range(10)]
    outs = llm.generate(prompts, params)
    for o, r, p in zip(outs, ref, params):
        assert o.token_ids == r[:p.max_tokens]
    assert _all_free(llm)


def test_chunked_prefill_mixed_with_decode(tiny_llama, reference):
    prompts, ref = reference
    llm = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=256, max_num_batched_tokens=7)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert _all_free(llm)


def test_prefix_caching_hits_and_same_output(tiny_llama, reference):
    prompts, ref = reference
    llm = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=256, block_size=16)
    first = llm.generate(prompts, GREEDY)
    assert llm.stats()["prefix_cache_hit_tokens"] == 0
    again = llm.generate(prompts, GREEDY)
    hits = llm.stats()["prefix_cache_hit_tokens"]
    assert hits == sum(((len(p) - 1) // 16) * 16 for p in prompts) and hits > 0
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == ref
    # a prompt that is fully cached (length a multiple of the block size) still computes its last token
    p32 = prompts[0] * 40
    p32 = p32[:32]
    a = llm.generate([p32], GREEDY)[0].token_ids
    b = llm.generate([p32], GREEDY)[0].token_ids
    assert a == b
    # shared system-prompt style prefix: different suffixes reuse the common blocks
    base = _prompts(1, seed=9, lo=40, hi=41)[0]
    before = llm.stats()["prefix_cache_hit_tokens"]
    llm.generate([base + [1, 2, 3]], GREEDY)
    llm.generate([base + [4, 5, 6, 7]], GREEDY)
    assert llm.stats()["prefix_cache_hit_tokens"] - before == 32
    assert _all_free(llm)


def test_preemption_when_blocks_run_out(tiny_llama, reference):
    prompts, ref = reference
    # 12 blocks x 16 = 192 tokens: far less than 10 requests x (up to 80) tokens at once
    llm = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=12, block_size=16, max_model_len=96)
    outs = llm.generate(prompts, GREEDY)
    assert llm.stats()["preemptions"] > 0
    assert [o.token_ids for o in outs] == ref
    assert _all_free(llm)


def test_abort_frees_blocks(tiny_llama):
    llm = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=64)
    eng = llm.engine
    eng.add_request("a", _prompts(1)[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    eng.add_request("b", _prompts(1, seed=4)[0], SamplingParams(temperature=0.7, max_tokens=50, n=2))
    for _ in range(3):
        eng.step()
    assert llm.stats()["kv_blocks_free"] < 64
    assert eng.abort_request("a") and eng.abort_request("b")
    assert not eng.abort_request("b")
    assert _all_free(llm)


def test_arrival_order_and_request_ids(tiny_llama):
    llm = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=64)
    eng = llm.engine
    eng.add_request("x", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("x", [1, 2, 3], GREEDY)
    assert [r.request_id for r in eng.scheduler.waiting] == ["x#0"]
    while eng.has_unfinished():
        eng.step()
    assert _all_free(llm)


def test_reset_prefix_cache_only_while_idle(tiny_llama, reference):
    prompts, ref = reference
    llm = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=64, block_size=16)
    eng, p = llm.engine, prompts[0] * 3

    def hits():
        return llm.stats()["prefix_cache_hit_tokens"]

    first = llm.generate([p], GREEDY)[0].token_ids
    eng.add_request("busy", p, GREEDY)
    eng.step()
    assert hits() > 0
    assert not llm.reset_prefix_cache()       # a request holds blocks: nothing is done
    while eng.has_unfinished():
        eng.step()
    assert llm.reset_prefix_cache()
    before = hits()
    assert llm.generate([p], GREEDY)[0].token_ids == first
    assert hits() == before                   # computed again: no prefix was left
    assert _all_free(llm)
