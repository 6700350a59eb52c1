"""Prompts given as input embeddings (vLLM's ``prompt_embeds``, ``enable_prompt_embeds``): the
tokens and logprobs are transformers' on the same ``inputs_embeds`` (fp32, greedy), alone, in a
batch beside token prompts, through chunked prefill, preemption and the prefix cache (which
serves a prompt's blocks only to the same embeddings); what cannot be served is a ValueError
that leaves the engine serving with every block back."""
from __future__ import annotations

import pytest
import torch

from blitzllm import LLM, SamplingParams

N = 8
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=2)


def hf_embeds_greedy(model, embeds: torch.Tensor, n: int) -> tuple:
    """transformers' greedy continuation of ``inputs_embeds`` [P, H]: (tokens, their logprobs)."""
    x, toks, lps = embeds[None], [], []
    with torch.no_grad():
        for _ in range(n):
            lp = model(inputs_embeds=x).logits[0, -1].float().log_softmax(-1)
            t = int(lp.argmax())
            toks.append(t)
            lps.append(float(lp[t]))
            x = torch.cat([x, model.get_input_embeddings()(torch.tensor([[t]]))], 1)
    return toks, torch.tensor(lps)


def _embeds(hf, n: int, seed: int) -> torch.Tensor:
    """Embeddings no token has: token embeddings scaled and noised (so the prompt is its own)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, hf.config.vocab_size, (n,), generator=g)
    with torch.no_grad():
        e = hf.get_input_embeddings()(ids)
    return (1.5 * e + 0.05 * torch.randn(e.shape, generator=g)).detach()


def _check(out, hf, embeds):
    toks, lps = hf_embeds_greedy(hf, embeds, N)
    got = out.outputs[0]
    assert got.token_ids == toks
    torch.testing.assert_close(torch.tensor([lp[t] for lp, t in zip(got.logprobs, got.token_ids)]), lps,
                               atol=1e-4, rtol=1e-4)


def _free(llm):
    st = llm.stats()
    assert not llm.engine.has_unfinished() and st["kv_blocks_free"] == st["kv_blocks_total"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama[0]), device="cpu", dtype="float32", kv_cache_blocks=64, enable_prompt_embeds=True,
               max_num_batched_tokens=32)


def test_embeds_match_transformers_beside_token_prompts(llm, tiny_llama):
    hf = tiny_llama[1]
    embeds = [_embeds(hf, n, seed) for n, seed in ((5, 1), (45, 2), (17, 3))]   # (45: chunked over steps)
    ids = [4, 9, 13, 77, 201, 8]
    outs = llm.generate([{"prompt_embeds": embeds[0]}, ids, {"prompt_embeds": embeds[1][None]},
                         {"prompt_embeds": embeds[2]}], GREEDY)
    for out, e in zip([outs[0], outs[2], outs[3]], embeds):
        _check(out, hf, e)
        assert out.prompt_token_ids is None and out.prompt is None
    plain = LLM(str(tiny_llama[0]), device="cpu", dtype="float32", kv_cache_blocks=64)
    assert outs[1].outputs[0].token_ids == plain.generate(ids, GREEDY)[0].outputs[0].token_ids
    # a token prompt's own embeddings give its tokens
    with torch.no_grad():
        own = hf.get_input_embeddings()(torch.tensor(ids))
    assert llm.generate({"prompt_embeds": own}, GREEDY)[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    _free(llm)


def test_prefix_cache_serves_only_the_same_embeddings(llm, tiny_llama):
    hf = tiny_llama[1]
    e = _embeds(hf, 40, 7)
    first = llm.generate({"prompt_embeds": e}, GREEDY)[0]
    again = llm.generate({"prompt_embeds": e.clone()}, GREEDY)[0]
    bs = llm.engine.args.block_size
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == (40 // bs) * bs > 0
    other = e.clone()
    other[0, 0] += 1e-3   # (one value apart: none of its blocks are the first's)
    moved = llm.generate({"prompt_embeds": other}, GREEDY)[0]
    assert moved.num_cached_tokens == 0
    _check(again, hf, e)
    _check(moved, hf, other)
    _free(llm)


def test_preempted_embeds_recompute_the_same_tokens(tiny_llama):
    """Too few KV blocks for the batch: requests are preempted and their prefills recomputed from
    the embeddings they keep."""
    hf = tiny_llama[1]
    small = LLM(str(tiny_llama[0]), device="cpu", dtype="float32", kv_cache_blocks=10, enable_prompt_embeds=True,
                enable_prefix_caching=False)
    embeds = [_embeds(hf, 30, 20 + i) for i in range(4)]
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = small.generate([{"prompt_embeds": e} for e in embeds], long)
    assert small.stats()["preemptions"] > 0
    for out, e in zip(outs, embeds):
        assert out.outputs[0].token_ids == hf_embeds_greedy(hf, e, 24)[0]
    _free(small)


def test_truncation_and_refusals(llm, tiny_llama):
    hf = tiny_llama[1]
    e = _embeds(hf, 20, 9)
    cut = llm.generate({"prompt_embeds": e}, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=2,
                                                            truncate_prompt_tokens=6))[0]
    _check(cut, hf, e[-6:])
    H = hf.config.hidden_size
    eng = llm.engine
    cases = [
        (dict(prompt_embeds=torch.zeros(4, H + 1)), "hidden size"),
        (dict(prompt_embeds=torch.zeros(2, 4, H)), "num_tokens"),
        (dict(prompt_embeds=torch.zeros(4, H, dtype=torch.long)), "floating-point"),
        (dict(prompt_embeds=torch.full((4, H), float("nan"))), "NaN"),
        (dict(prompt_embeds=torch.zeros(0, H)), "empty"),
        (dict(prompt_embeds=e, prompt=[1, 2]), "not both"),
        (dict(prompt_embeds=e, params=SamplingParams(prompt_logprobs=1)), "prompt_logprobs"),
        (dict(prompt_embeds=e, params=SamplingParams(max_tokens=600)), "max_model_len"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            eng.add_request("bad", kw.pop("prompt", None), kw.pop("params", GREEDY), **kw)
    from blitzllm import PoolingParams
    with pytest.raises(ValueError, match="generation"):
        eng.add_request("bad", None, PoolingParams(), prompt_embeds=e)
    with pytest.raises(ValueError, match="a tensor, got None"):
        llm.generate({"prompt_embeds": None}, GREEDY)
    plain = LLM(str(tiny_llama[0]), device="cpu", dtype="float32", kv_cache_blocks=16)
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        plain.generate({"prompt_embeds": e}, GREEDY)
    _free(llm)
    _check(llm.generate({"prompt_embeds": e}, GREEDY)[0], hf, e)   # (still serving)
