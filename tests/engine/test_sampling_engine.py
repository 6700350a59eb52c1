"""Sampling through the whole engine: seeded reproducibility regardless of batch, n>1,
stop strings and stop tokens, logprobs shape."""
import torch

from blitzllm import LLM, SamplingParams


def _prompts(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 320, (int(L),), generator=g).tolist() for L in torch.randint(3, 30, (n,), generator=g)]


def test_seeded_sampling_reproducible_across_batches(tiny_llama):
    llm = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=128)
    target = [7, 8, 9, 10, 11]
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([target], p)[0].token_ids
    again = llm.generate([target], p)[0].token_ids
    others = _prompts(5)
    mixed = llm.generate(others[:3] + [target] + others[3:],
                         [SamplingParams(temperature=0.8, max_tokens=9, ignore_eos=True)] * 3 + [p]
                         + [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 2)
    assert alone == again == mixed[3].token_ids
    other_seed = llm.generate([target], p.clone(seed=99))[0].token_ids
    assert other_seed != alone


def test_unseeded_requests_follow_engine_seed(tiny_llama):
    p = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    a = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=64, seed=3).generate([[1, 2, 3]], p)[0].token_ids
    b = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=64, seed=3).generate([[1, 2, 3]], p)[0].token_ids
    assert a == b


def test_n_samples_are_distinct(tiny_llama):
    llm = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=128)
    out = llm.generate([[4, 5, 6]], SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True, seed=7))[0]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert len(seqs) == 4 and len(set(seqs)) == 4
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert llm.stats()["kv_blocks_free"] == 128


def test_logprobs_shape(tiny_llama):
    llm = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.5, max_tokens=6, logprobs=3, ignore_eos=True, seed=1))[0]
    assert len(out.logprobs) == 6
    for tok, d in zip(out.token_ids, out.logprobs):
        assert tok in d and 3 <= len(d) <= 4
        assert all(v <= 0 for v in d.values())
        top3 = sorted(d.values(), reverse=True)[:3]
        assert abs(sum(torch.tensor(top3).exp()).item()) <= 1.0 + 1e-5


def test_stop_strings_cut_across_token_boundaries(smollm2_llm):
    llm = smollm2_llm
    q = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    full = llm.chat(q, SamplingParams(temperature=0, max_tokens=60))[0]
    # a stop string that spans several tokens ("7", "\n", "8")
    stop = "7\n8"
    assert stop in full.text
    cut = llm.chat(q, SamplingParams(temperature=0, max_tokens=60, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    keep = llm.chat(q, SamplingParams(temperature=0, max_tokens=60, stop=[stop], include_stop_str_in_output=True))[0]
    assert keep.text == full.text[: full.text.index(stop) + len(stop)]
    assert stop not in cut.text
    # stop_token_ids: stop at the token generated at step 3
    t3 = full.token_ids[3]
    st = llm.chat(q, SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[t3]))[0]
    assert st.token_ids == full.token_ids[: full.token_ids.index(t3) + 1] and st.finish_reason == "stop"
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_min_tokens_and_max_tokens(smollm2_llm):
    q = [{"role": "user", "content": "Say hi."}]
    short = smollm2_llm.chat(q, SamplingParams(temperature=0, max_tokens=64))[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 64
    longer = smollm2_llm.chat(q, SamplingParams(temperature=0, max_tokens=64, min_tokens=len(short.token_ids) + 5))[0]
    assert len(longer.token_ids) >= len(short.token_ids) + 5
    capped = smollm2_llm.chat(q, SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(capped.token_ids) == 3 and capped.finish_reason == "length"


def test_include_stop_str_in_output_keeps_a_stop_tokens_text(smollm2_llm):
    """As vLLM: the text of the token that stopped the output (a stop_token_ids entry, EOS) is in
    the text with include_stop_str_in_output, and only then (before: never)."""
    llm, tok = smollm2_llm, smollm2_llm.tokenizer
    prompt = "1, 2, 3, 4, 5, 6, 7,"
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    t3 = full.token_ids[3]
    n = full.token_ids.index(t3) + 1
    assert tok.decode([t3])
    for include in (False, True):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[t3],
                                                    include_stop_str_in_output=include))[0]
        assert out.token_ids == full.token_ids[:n] and out.outputs[0].stop_reason == t3
        assert out.text == tok.decode(full.token_ids[:n if include else n - 1])
    q = llm.apply_chat_template([{"role": "user", "content": "Say hi."}])
    for include in (False, True):
        out = llm.generate([q], SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False,
                                               include_stop_str_in_output=include))[0]
        assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids
        ids = out.token_ids if include else out.token_ids[:-1]
        assert out.text == tok.decode(ids, skip_special_tokens=False)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_min_tokens_holds_stop_strings_off(smollm2_llm):
    """As vLLM: no stop string may end in the text of the first min_tokens tokens (before: the
    output stopped at the first "," under min_tokens 5, with 3 tokens)."""
    llm, prompt = smollm2_llm, "1, 2, 3, 4, 5, 6, 7,"
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    for min_tokens in (0, 2, 5, 8):
        head = len(llm.tokenizer.decode(full.token_ids[:min_tokens]))
        cut = full.text.index(",", head)
        n = next(i for i in range(1, 21) if len(llm.tokenizer.decode(full.token_ids[:i])) > cut)
        assert n > min_tokens
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop=[","],
                                                    min_tokens=min_tokens))[0]
        assert out.token_ids == full.token_ids[:n] and out.text == full.text[:cut]
        assert out.finish_reason == "stop" and out.outputs[0].stop_reason == ","
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_tiny_temperatures_sample_greedily(tiny_llama):
    """A temperature under 1e-5 is greedy (1e-40 divided the logits into inf, NaN probabilities and
    token 0 at every step); 1e-5 itself still samples, here as greedy as makes no difference."""
    llm = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=64)
    prompts = _prompts(3)
    greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    for t in (1e-40, 1e-9, 1e-5):
        p = SamplingParams(temperature=t, max_tokens=12, ignore_eos=True, seed=7)
        assert p.greedy == (t < 1e-5)
        assert [o.token_ids for o in llm.generate(prompts, p)] == greedy
    assert llm.stats()["kv_blocks_free"] == 64
