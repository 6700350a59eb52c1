"""vLLM's priority scheduling (``scheduling_policy="priority"``): lower priority values are
served first, ties by arrival; a waiting request preempts running ones of a lower priority when
there is no room (sequences or blocks); every answer is the one it gets alone (greedy, the
preempted request recomputed), and every run ends with all KV blocks free. Under fcfs a
priority other than 0 is the caller's mistake."""
import pytest

from blitzllm import LLM, SamplingParams
from tests.engine.test_engine_features import _all_free, _prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _llm(tiny_llama, policy, **kw):
    return LLM(str(tiny_llama[0]), device="cpu", scheduling_policy=policy, **kw)


def _run(eng, finished: list) -> dict:
    """Step until idle; ``finished`` gets the request ids in the order they end; returns the
    token ids of each."""
    toks = {}
    while eng.has_unfinished():
        for ev in eng.step():
            toks.setdefault(ev.request_id, []).extend(ev.new_token_ids)
            if ev.finish_reason is not None:
                finished.append(ev.request_id)
    return toks


@pytest.fixture(scope="module")
def alone(tiny_llama):
    """Each prompt's greedy answer generated alone."""
    llm = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=64, enable_prefix_caching=False)
    prompts = _prompts(4, seed=11, lo=40, hi=60)
    return prompts, [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]


def test_waiting_requests_start_by_priority_then_arrival(tiny_llama, alone):
    prompts, ref = alone
    llm = _llm(tiny_llama, "priority", kv_cache_blocks=64, max_num_seqs=1)
    eng = llm.engine
    for rid, p, prio in zip("abcd", prompts, (5, 0, 5, -1)):
        eng.add_request(rid, p, GREEDY, priority=prio)
    assert [r.request_id for r in eng.scheduler.waiting] == ["d#0", "b#0", "a#0", "c#0"]
    order = []
    toks = _run(eng, order)
    assert order == ["d", "b", "a", "c"]
    assert [toks[r] for r in "abcd"] == ref
    assert eng.scheduler.num_preemptions == 0 and _all_free(llm)


def test_llm_generate_takes_a_priority_per_prompt(tiny_llama, alone):
    prompts, ref = alone
    llm = _llm(tiny_llama, "priority", kv_cache_blocks=64, max_num_seqs=2)
    outs = llm.generate(prompts, GREEDY, priority=[3, 2, 1, 0])
    assert [o.outputs[0].token_ids for o in outs] == ref
    with pytest.raises(ValueError, match="one integer per prompt"):
        llm.generate(prompts, GREEDY, priority=[0])
    assert _all_free(llm)


def test_a_higher_priority_preempts_a_running_request_at_the_sequence_limit(tiny_llama, alone):
    prompts, ref = alone
    llm = _llm(tiny_llama, "priority", kv_cache_blocks=64, max_num_seqs=1)
    eng = llm.engine
    eng.add_request("low", prompts[0], GREEDY, priority=1)
    order, toks = [], {}
    for _ in range(4):  # the prefill and three decode steps
        for ev in eng.step():
            toks.setdefault(ev.request_id, []).extend(ev.new_token_ids)
    assert len(toks["low"]) == 4
    eng.add_request("high", prompts[1], GREEDY, priority=0)
    eng.add_request("same", prompts[2], GREEDY, priority=1)  # equal to the running one's: waits its turn
    for rid, t in _run(eng, order).items():
        toks[rid] = toks.get(rid, []) + t
    assert order == ["high", "low", "same"]
    assert eng.scheduler.num_preemptions == 1
    # the preempted request recomputes its prompt and the tokens it had, then goes on unchanged
    assert [toks["low"], toks["high"], toks["same"]] == ref[:3]
    assert _all_free(llm)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_blocks_short_a_higher_priority_preempts_only_under_the_priority_policy(tiny_llama, alone, policy):
    prompts, ref = alone
    # 6 blocks of 16 tokens: a 40-59 token prompt with its 12 new tokens holds 4, so two never fit
    llm = _llm(tiny_llama, policy, kv_cache_blocks=6, block_size=16, max_model_len=96,
               enable_prefix_caching=False)
    eng = llm.engine
    eng.add_request("low", prompts[0], GREEDY, priority=0 if policy == "fcfs" else 7)
    first = eng.step()[0].new_token_ids  # its prefill and first token
    eng.add_request("high", prompts[1], GREEDY)
    order = []
    toks = _run(eng, order)
    if policy == "fcfs":
        assert order == ["low", "high"] and eng.scheduler.num_preemptions == 0
    else:
        assert order == ["high", "low"] and eng.scheduler.num_preemptions == 1
    assert toks["high"] == ref[1] and first + toks["low"] == ref[0]
    assert _all_free(llm)


def test_priority_needs_the_priority_policy_and_an_integer(tiny_llama):
    llm = _llm(tiny_llama, "fcfs", kv_cache_blocks=16)
    with pytest.raises(ValueError, match="priority 2 needs priority scheduling"):
        llm.engine.add_request("x", [1, 2, 3], GREEDY, priority=2)
    with pytest.raises(ValueError, match="priority 2 needs priority scheduling"):
        llm.generate([[1, 2, 3]], GREEDY, priority=[2])
    llm.engine.add_request("y", [1, 2, 3], GREEDY, priority=0)  # 0 is every fcfs request's
    _run(llm.engine, [])
    strict = _llm(tiny_llama, "priority", kv_cache_blocks=16)
    for bad in (True, "1", 1.5, None, 2**63):
        with pytest.raises(ValueError, match="priority must be an integer"):
            strict.engine.add_request("z", [1, 2, 3], GREEDY, priority=bad)
    assert not strict.engine.has_unfinished() and _all_free(llm) and _all_free(strict)
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        _llm(tiny_llama, "lifo")
