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
