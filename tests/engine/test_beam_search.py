"""vLLM's beam search (``LLM.beam_search``, engine/beam_search.py) against the definition, written
here again on transformers' logits of SmolLM2 (float32): each step every beam is extended by its
2 * beam_width most likely tokens, extensions ending in EOS are complete, the beam_width best
others by cum_logprob / len ** length_penalty (prompt included, a final EOS not) go on; the
answer is the beam_width best of the completed and the live beams."""
import pytest
import torch

from blitzllm import BeamSearchParams, SamplingParams
from blitzllm.engine.beam_search import BeamSearch

PROMPT = "The three most common pets are"


def reference(hf, prompt: list, w: int, max_tokens: int, eos: tuple, length_penalty: float) -> list:
    def score(seq):
        toks, cum = seq
        return cum / (len(toks) - (toks[-1] in eos)) ** length_penalty

    beams, done = [(prompt, 0.0)], []
    with torch.no_grad():
        for _ in range(max_tokens):
            cands = []
            for toks, cum in beams:
                lp = torch.log_softmax(hf(torch.tensor([toks])).logits[0, -1].double(), -1)
                top = torch.topk(lp, 2 * w)
                for t, v in zip(top.indices.tolist(), top.values.tolist()):
                    (done if t in eos else cands).append((toks + [t], cum + v))
            beams = sorted(cands, key=score, reverse=True)[:w]
    return sorted(done + beams, key=score, reverse=True)[:w]


@pytest.mark.parametrize("w,length_penalty", [(3, 1.0), (2, 0.0)])
def test_beam_search_is_the_definitions(smollm2_llm, smollm2_hf, w, length_penalty):
    llm = smollm2_llm
    ids = llm.tokenize(PROMPT)
    eos = llm.engine.eos_token_ids
    want = reference(smollm2_hf, ids, w, 6, eos, length_penalty)
    out = llm.beam_search([PROMPT, {"prompt_token_ids": ids}],
                          BeamSearchParams(beam_width=w, max_tokens=6, length_penalty=length_penalty))
    assert len(out) == 2
    for res in out:
        got = res.sequences
        assert [s.tokens for s in got] == [t for t, _ in want]
        for s, (_, cum) in zip(got, want):
            assert s.cum_logprob == pytest.approx(cum, abs=2e-3)
            assert s.finish_reason == "length" and len(s.logprobs) == 6
            assert s.text == llm.tokenizer.decode(s.tokens[len(ids):], skip_special_tokens=True)
    # beam width 1 is greedy decoding
    one = llm.beam_search(PROMPT, BeamSearchParams(beam_width=1, max_tokens=6)).pop().sequences[0]
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert one.tokens[len(ids):] == greedy.outputs[0].token_ids
    s = llm.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]


def test_a_beam_that_reaches_eos_is_complete():
    # made-up steps: the best extension of the prompt is EOS (id 0): it is set aside, complete,
    # and kept where its score beats the live beams'
    p = BeamSearchParams(beam_width=2, max_tokens=2)
    s = BeamSearch([5, 6], p, eos_ids=(0,), max_model_len=64)
    s.advance([{0: -0.1, 7: -1.0, 8: -2.0, 9: -3.0}])
    assert [b.tokens for b in s.completed] == [[5, 6, 0]] and [b.tokens for b in s.beams] == [[5, 6, 7], [5, 6, 8]]
    s.advance([{1: -5.0, 2: -6.0, 3: -7.0, 4: -8.0}, {1: -0.5, 2: -9.0, 3: -9.5, 4: -9.9}])
    assert not s.live()
    best = s.best(lambda ids: ",".join(map(str, ids)))
    # scores: EOS beam -0.1 / 2 (its EOS not counted); [5,6,8,1]: -2.5 / 4; [5,6,7,1]: -6 / 4
    assert [b.tokens for b in best] == [[5, 6, 0], [5, 6, 8, 1]]
    assert [b.finish_reason for b in best] == ["stop", "length"] and best[0].stop_reason == 0
    assert best[0].text == "" and best[1].text == "8,1"
    ignore = BeamSearch([5, 6], BeamSearchParams(beam_width=2, max_tokens=1, ignore_eos=True), (0,), 64)
    ignore.advance([{0: -0.1, 7: -1.0, 8: -2.0, 9: -3.0}])
    assert [b.tokens for b in ignore.best(str)] == [[5, 6, 0], [5, 6, 7]]


def test_the_context_length_ends_a_beam():
    s = BeamSearch([5, 6], BeamSearchParams(beam_width=1, max_tokens=10), (0,), max_model_len=3)
    assert s.live()
    s.advance([{7: -1.0, 8: -2.0}])
    assert not s.live() and [(b.tokens, b.finish_reason) for b in s.best(str)] == [([5, 6, 7], "length")]


@pytest.mark.parametrize("kw,msg", [
    (dict(beam_width=0, max_tokens=4), "beam_width must be an integer in [1, 10]"),
    (dict(beam_width=11, max_tokens=4), "beam_width must be an integer in [1, 10]"),
    (dict(beam_width=True, max_tokens=4), "beam_width must be an integer"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty must be a finite number"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature must be >= 0"),
    (dict(beam_width=2, max_tokens=4, length_penalty=1e6), "length_penalty must be in [-10.0, 10.0]"),
    (dict(beam_width=2, max_tokens=4, ignore_eos="yes"), "ignore_eos must be true or false"),
])
def test_bad_beam_search_params(kw, msg):
    with pytest.raises(ValueError) as e:
        BeamSearchParams(**kw)
    assert msg in str(e.value)


def test_a_prompt_too_long_is_refused(tiny_llama):
    from blitzllm import LLM
    llm = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=8, max_model_len=32)
    with pytest.raises(ValueError, match="no room to generate"):
        llm.beam_search([list(range(1, 40))], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search("hi", SamplingParams())
    from PIL import Image
    image_prompt = {"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": Image.new("RGB", (8, 8))}}
    with pytest.raises(ValueError, match=r"beam_search takes text or token-id prompts; images \(multi_modal_data\)"):
        llm.beam_search([[4, 5], image_prompt], BeamSearchParams(beam_width=2, max_tokens=4))
    s = llm.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
