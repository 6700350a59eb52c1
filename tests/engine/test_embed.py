"""``LLM.embed``: pooled final hidden states against transformers' ``last_hidden_state`` (after the
final norm, the same tensor our models hand to ``compute_logits``), through chunked prefill,
mixed batches, generation in the same steps, speculative decoding, the prefix cache, and the
pooling defaults a model folder's sentence-transformers files set.

Everything runs in float32 on the CPU: the two implementations differ only in summation order,
so the vectors agree to ~1e-6; 1e-4 leaves room for that and would still catch any wrong row."""
import json
import shutil

import pytest
import torch

from blitzllm import LLM, EmbeddingRequestOutput, PoolingParams, SamplingParams
from blitzllm.pooling_params import PoolerConfig, parse_pooler_config

TOL = 1e-4
LONG = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. " * 8  # ~150 tokens


def hf_vector(hf_body, ids: list, kind: str = "LAST", normalize: bool = True, dims=None) -> torch.Tensor:
    """The reference: transformers' final hidden states of ``ids`` alone, pooled here."""
    with torch.no_grad():
        h = hf_body(torch.tensor([ids])).last_hidden_state[0].float()
    v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]
    if dims is not None:
        v = v[:dims]
    return torch.nn.functional.normalize(v, dim=-1) if normalize else v


def close(out, ref: torch.Tensor) -> bool:
    got = torch.tensor(out.outputs.embedding if isinstance(out, EmbeddingRequestOutput) else out)
    return got.shape == ref.shape and torch.allclose(got, ref, atol=TOL, rtol=0)


_LLMS = {}


@pytest.fixture(scope="module", autouse=True)
def _drop_llms():
    yield
    _LLMS.clear()   # (module globals live for the whole session: three SmolLM2 engines, a GB each)


def chunked_llm(kind: str) -> LLM:
    """SmolLM2 pooling ``kind`` by default, with a step budget of 64 tokens (LONG runs in chunks)."""
    if kind not in _LLMS:
        _LLMS[kind] = LLM("smollm2", dtype="float32", device="cpu", max_num_batched_tokens=64, max_model_len=256,
                          pooler_config={"pooling_type": kind})
    return _LLMS[kind]


def no_leaks(llm: LLM) -> None:
    e = llm.engine
    assert not e.has_unfinished() and not e.requests
    assert e.kv.num_free_blocks == e.kv.num_blocks


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_pooling_types_match_transformers_across_chunks_and_a_mixed_batch(smollm2_hf, kind):
    llm = chunked_llm(kind)
    prompts = [LONG, "Hello, my name is", "Paris is the capital of France, and Berlin"]
    outs = llm.embed(prompts)
    assert len(llm.tokenize(LONG)) > 2 * 64   # (three chunks at least)
    for p, o in zip(prompts, outs):
        assert o.finished and o.prompt_token_ids == llm.tokenize(p)
        assert len(o.outputs.embedding) == 576 == o.outputs.hidden_size
        assert close(o, hf_vector(smollm2_hf.model, o.prompt_token_ids, kind))
    raw = llm.embed(prompts[1], PoolingParams(normalize=False))[0]
    assert close(raw, hf_vector(smollm2_hf.model, raw.prompt_token_ids, kind, normalize=False))
    no_leaks(llm)


def test_default_is_last_token_normalized_and_chunking_does_not_change_it(smollm2_llm, smollm2_hf):
    whole = smollm2_llm.embed([LONG, {"prompt_token_ids": [1, 2, 3]}])
    assert close(whole[0], hf_vector(smollm2_hf.model, whole[0].prompt_token_ids))
    assert whole[1].prompt_token_ids == [1, 2, 3]
    assert abs(sum(x * x for x in whole[0].outputs.embedding) - 1.0) < 1e-5
    chunked = chunked_llm("LAST").embed(LONG)[0]
    assert close(chunked, torch.tensor(whole[0].outputs.embedding))
    no_leaks(smollm2_llm)


def test_truncate_prompt_tokens_keeps_the_last_ones(smollm2_hf):
    llm = chunked_llm("MEAN")
    ids = llm.tokenize(LONG)
    out = llm.embed(LONG, PoolingParams(truncate_prompt_tokens=20))[0]
    assert out.prompt_token_ids == ids[-20:]
    assert close(out, hf_vector(smollm2_hf.model, ids[-20:], "MEAN"))


def test_mean_over_a_cached_prefix_computes_the_whole_prompt(smollm2_hf):
    """A prefix-cache hit would skip positions MEAN needs: such a request takes no hit. LAST
    needs only the last position: it takes the hit, and its vector stays the same."""
    llm = chunked_llm("MEAN")
    first = llm.embed(LONG)[0]
    hits = llm.stats()["prefix_cache_hit_tokens"]
    again = llm.embed(LONG)[0]
    assert llm.stats()["prefix_cache_hit_tokens"] == hits
    assert close(again, torch.tensor(first.outputs.embedding))
    assert close(again, hf_vector(smollm2_hf.model, first.prompt_token_ids, "MEAN"))
    last = chunked_llm("LAST")
    a = last.embed(LONG)[0]
    hits = last.stats()["prefix_cache_hit_tokens"]
    b = last.embed(LONG)[0]
    assert last.stats()["prefix_cache_hit_tokens"] > hits
    assert close(b, torch.tensor(a.outputs.embedding))
    no_leaks(llm)
    no_leaks(last)


def test_embedding_shares_steps_with_generation_which_is_unchanged(smollm2_hf):
    llm = chunked_llm("LAST")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = llm.generate(["Once upon a time"], params)[0].token_ids
    e = llm.engine
    e.add_request("g", "Once upon a time", params)
    got = [t for ev in e.step() for t in ev.new_token_ids]   # its prefill and first token
    fresh = "Rivers run down from the mountains to the sea, carrying stones and sand. " * 8  # (no cache hits)
    e.add_request("e", fresh, PoolingParams())
    emb, shared = None, 0
    while e.has_unfinished():
        running = {r.request_id for r in e.scheduler.running} | {r.request_id for r in e.scheduler.waiting}
        shared += {"g#0", "e#0"} <= running
        for ev in e.step():
            if ev.request_id == "g":
                got += ev.new_token_ids
            else:
                assert ev.finish_reason == "stop" and not ev.new_token_ids
                emb = ev.embedding
    assert shared >= 2 and got == want
    assert close(emb, hf_vector(smollm2_hf.model, llm.tokenize(fresh)))
    no_leaks(llm)


def test_speculative_decoding_skips_embeddings(tiny_llama):
    path, hf = tiny_llama
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], list(range(20, 60))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(path), device="cpu", kv_cache_blocks=256).generate(prompts, params)]
    llm = LLM(str(path), device="cpu", kv_cache_blocks=256, max_num_batched_tokens=16,
              speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "model": str(path)})
    e = llm.engine
    e.add_request("g", prompts[0], params)
    got, emb = [t for ev in e.step() for t in ev.new_token_ids], {}
    for rid, ids in (("e1", prompts[1]), ("e2", [3] * 30)):
        e.add_request(rid, ids, PoolingParams())
    while e.has_unfinished():
        for ev in e.step():
            got += ev.new_token_ids
            if ev.embedding is not None:
                emb[ev.request_id] = ev.embedding
    assert got == want[0] and llm.generate(prompts, params)[1].token_ids == want[1]
    assert llm.stats()["spec_draft_tokens"] > 0
    assert close(emb["e1"], hf_vector(hf.model, prompts[1])) and close(emb["e2"], hf_vector(hf.model, [3] * 30))
    no_leaks(llm)


def test_sentence_transformers_files_and_matryoshka_dimensions(tiny_llama, tmp_path):
    path, hf = tiny_llama
    folder = tmp_path / "st"
    shutil.copytree(path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32]}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_lasttoken": False}))
    ids = list(range(10, 40))
    llm = LLM(str(folder), device="cpu", kv_cache_blocks=64)
    assert llm.engine.pooling.config == PoolerConfig("MEAN", True)
    assert close(llm.embed(ids)[0], hf_vector(hf.model, ids, "MEAN"))
    out = llm.embed(ids, PoolingParams(dimensions=16))[0]
    assert close(out, hf_vector(hf.model, ids, "MEAN", dims=16))
    with pytest.raises(ValueError, match=r"dimensions must be one of .*\[16, 32\], got 8"):
        llm.embed(ids, PoolingParams(dimensions=8))
    # the flag's keys over the files'
    llm = LLM(str(folder), device="cpu", kv_cache_blocks=64, pooler_config='{"normalize": false}')
    assert llm.engine.pooling.config == PoolerConfig("MEAN", False)
    assert close(llm.embed(ids)[0], hf_vector(hf.model, ids, "MEAN", normalize=False))
    no_leaks(llm)
    # a pooling mode we do not have: refused per request (generation still runs) unless the flag names a type
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    llm = LLM(str(folder), device="cpu", kv_cache_blocks=64)
    with pytest.raises(ValueError, match="pooling 'pooling_mode_max_tokens' is not supported"):
        llm.embed(ids)
    assert len(llm.generate([ids], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2
    no_leaks(llm)
    llm = LLM(str(folder), device="cpu", kv_cache_blocks=64, pooler_config={"pooling_type": "cls"})
    assert llm.engine.pooling.config == PoolerConfig("CLS", True)   # (the files' Normalize kept)
    assert close(llm.embed(ids)[0], hf_vector(hf.model, ids, "CLS"))


@pytest.mark.parametrize("kwargs, match", [
    (dict(dimensions=0), "dimensions"), (dict(dimensions=True), "dimensions"), (dict(dimensions=2.0), "dimensions"),
    (dict(normalize="yes"), "normalize"), (dict(normalize=1), "normalize"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"), (dict(truncate_prompt_tokens=False), "truncate"),
])
def test_bad_pooling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoolingParams(**kwargs)


@pytest.mark.parametrize("value, match", [
    ({"pooling_type": "MAX"}, "pooling_type must be one of LAST, MEAN, CLS"), ('{"pooling_type": 3}', "pooling_type"),
    ({"normalize": "no"}, "normalize"), ({"softmax": True}, "unknown: softmax"), ("{not json", "JSON object"),
    ("[1]", "JSON object"),
])
def test_bad_pooler_config(value, match):
    with pytest.raises(ValueError, match=match):
        parse_pooler_config(value)
    with pytest.raises(ValueError, match=match):
        LLM("smollm2", device="cpu", pooler_config=value)


def test_bad_requests_are_refused_and_leave_nothing():
    llm = chunked_llm("LAST")
    n = llm.engine.max_model_len
    for prompt, params, match in [
        ("Hi", PoolingParams(dimensions=8), "does not support matryoshka"),
        ([[]], None, "empty"), ([10**9], None, "prompt token ids"), ([1] * (n + 1), None, "max_model_len"),
        ("Hi", PoolingParams(truncate_prompt_tokens=n + 1), "truncate_prompt_tokens"),
        (["Hi", [10**9]], None, "prompt token ids"),   # (the first, already added, is aborted)
        ("Hi", SamplingParams(), "PoolingParams"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.embed(prompt, params)
        no_leaks(llm)
    assert len(llm.embed([1] * n)[0].outputs.embedding) == 576   # (a prompt may fill the context)
    no_leaks(llm)


@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_hybrid_gdn_model(tmp_path, kind):
    """A Qwen3-Next checkpoint (gated delta net layers with recurrent states beside attention):
    chunked (budget 16), and again (LAST from the prefix cache and its state snapshots), the
    vectors are transformers'; no state slot or block stays held."""
    from tests.models.test_qwen3_next import _prompts, assert_no_leaks, make_hybrid_checkpoint
    hf = make_hybrid_checkpoint("qwen3_next", tmp_path, seed=5)
    prompts = _prompts((1, 5, 17, 40))
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=64, max_num_batched_tokens=16,
              pooler_config={"pooling_type": kind})
    for _ in range(2):
        gen = llm.engine
        gen.add_request("g", prompts[2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        gen.step()
        for p, o in zip(prompts, llm.embed(prompts)):
            assert torch.allclose(torch.tensor(o.outputs.embedding), hf_vector(hf.model, p, kind), atol=1e-3, rtol=0)
        while gen.has_unfinished():
            gen.step()
        assert_no_leaks(llm)
