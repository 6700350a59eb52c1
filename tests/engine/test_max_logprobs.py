"""max_logprobs (vLLM's --max-logprobs): the most logprobs / prompt_logprobs a request may ask
per token, 20 by default, -1 for the whole vocabulary. Past it a request is a ValueError that
leaves the engine serving with every KV block free; within it the top-k are transformers' own
(log_softmax of its logits, fp32)."""
import pytest
import torch

from blitzllm import LLM, SamplingParams
from tests.conftest import make_tiny_checkpoint

PROMPT = [5, 17, 101, 33, 250, 9]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    return path, make_tiny_checkpoint("llama", path, seed=4)


def _hf_logprobs(hf, ids: list) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _check_top(got: dict, row: torch.Tensor, k: int, chosen: int):
    ids = row.topk(k).indices
    assert set(ids.tolist()) <= set(got) and set(got) <= set(ids.tolist()) | {chosen}
    for t in got:
        assert abs(got[t] - row[t].item()) < 1e-4


def test_default_cap_refuses_past_20_and_keeps_serving(tiny):
    llm = LLM(str(tiny[0]), device="cpu", dtype="float32", kv_cache_blocks=32)
    total = llm.stats()["kv_blocks_total"]
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field} must be at most 20 .*max_logprobs.*got 21"):
            llm.generate([PROMPT], SamplingParams(max_tokens=3, **{field: 21}))
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, logprobs=20, prompt_logprobs=20))[0]
    assert all(len(lp) >= 20 for lp in out.logprobs)
    assert llm.stats()["kv_blocks_free"] == total
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= -1"):
        LLM(str(tiny[0]), device="cpu", dtype="float32", kv_cache_blocks=32, max_logprobs=-2)


def test_a_raised_cap_returns_transformers_top_k(tiny):
    path, hf = tiny
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_blocks=32, max_logprobs=50)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=50,
                                                prompt_logprobs=50))[0]
    ref = _hf_logprobs(hf, PROMPT + out.token_ids)
    for i, (lp, t) in enumerate(zip(out.logprobs, out.token_ids)):
        _check_top(lp, ref[len(PROMPT) - 1 + i], 50, t)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(PROMPT)):
        _check_top(out.prompt_logprobs[i], ref[i - 1], 50, PROMPT[i])
    with pytest.raises(ValueError, match="logprobs must be at most 50"):
        llm.generate([PROMPT], SamplingParams(max_tokens=1, logprobs=51))


def test_minus_one_is_the_whole_vocabulary(tiny):
    path, hf = tiny
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_blocks=32, max_logprobs=-1)
    V = llm.engine.model_config.vocab_size
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=V))[0]
    ref = _hf_logprobs(hf, PROMPT + out.token_ids)
    for i, lp in enumerate(out.logprobs):
        assert sorted(lp) == list(range(V))
        got = torch.tensor([lp[t] for t in range(V)])
        torch.testing.assert_close(got, ref[len(PROMPT) - 1 + i], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match=f"logprobs must be at most {V}"):
        llm.generate([PROMPT], SamplingParams(max_tokens=1, logprobs=V + 1))


def test_beam_search_within_the_cap(tiny):
    """A beam ranks 2 * beam_width candidates a step: a cap below that refuses the width up front,
    naming both."""
    from blitzllm import BeamSearchParams
    llm = LLM(str(tiny[0]), device="cpu", dtype="float32", kv_cache_blocks=32, max_logprobs=4)
    with pytest.raises(ValueError, match=r"beam_width 3 ranks 2 \* 3 candidates .*max_logprobs \(4\)"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=2))
    out = llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=2))[0]
    assert len(out.sequences) == 2
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
