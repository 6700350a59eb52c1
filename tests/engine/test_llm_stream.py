"""``LLM.stream``: the text of one prompt as the engine produces it."""
from blitzllm import SamplingParams


def test_stream_yields_the_generated_text_and_frees_its_blocks(smollm2_llm):
    llm = smollm2_llm
    ids = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    params = SamplingParams(temperature=0, max_tokens=12)
    want = llm.generate([ids], params)[0].outputs[0].text
    pieces = list(llm.stream(ids, params))
    assert len(pieces) > 1 and "".join(pieces) == want
    assert not llm.engine.has_unfinished()


def test_stream_stopped_early_aborts_the_request(smollm2_llm):
    llm = smollm2_llm
    stream = llm.stream(llm.tokenize("Once upon a time"), SamplingParams(temperature=0, max_tokens=64,
                                                                        ignore_eos=True))
    first = next(stream)
    assert first
    stream.close()
    assert not llm.engine.has_unfinished()
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_stream_of_n_samples_leaves_none_behind(smollm2_llm):
    """With n > 1 the stream follows sample 0; when it ends before the others they are aborted too
    (before: they stayed in the engine, and the next generate() met their events: KeyError)."""
    llm = smollm2_llm
    ids = llm.apply_chat_template([{"role": "user", "content": "Say yes or no."}])
    for seed in range(20):  # a seed whose sample 0 ends before another sample does
        params = SamplingParams(n=3, temperature=1.0, seed=seed, max_tokens=40)
        outs = llm.generate([ids], params)[0].outputs
        if len(outs[0].token_ids) < max(len(o.token_ids) for o in outs[1:]):
            break
    else:
        raise AssertionError("no seed ends sample 0 first")
    assert "".join(llm.stream(ids, params)) == outs[0].text
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=2))[0].finish_reason is not None


def test_streams_and_generate_interleaved_each_get_their_own_text(smollm2_llm):
    """Two streams read in turns, and a generate() between a stream's chunks: each caller gets its
    own request's text (before: a step's events went to whoever stepped, so interleaved streams lost
    each other's text, and a generate() inside a stream raised KeyError)."""
    llm = smollm2_llm
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.text for o in llm.generate(prompts, params)]
    a, b = llm.stream(prompts[0], params), llm.stream(prompts[1], params)
    got_a, got_b = [next(a)], [next(b)]
    assert llm.generate([prompts[2]], params)[0].text == want[2]
    for x, y in zip(a, b):
        got_a.append(x)
        got_b.append(y)
    got_a += list(a)
    got_b += list(b)
    assert ["".join(got_a), "".join(got_b)] == want[:2]
    assert not llm.engine.has_unfinished() and not llm.engine.requests and not llm._inbox
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
