"""DeepSeek-V3.2 (sparse MLA with the lightning indexer) on tiny random checkpoints.

Where the oracle falls short: transformers' indexer breaks ties among equal scores with
``torch.topk``, whose choice depends on the width of the row it gets (a row of a multi-token
forward carries -inf entries for the future keys; a decode step's row does not). Ties are
common: a key scores exactly 0 for a query when every head's q . k is <= 0 (ReLU), so with few
indexer heads several keys tie at 0, often at the k-th place. transformers' long forward is then
not causal (``test_oracle_noncausal_only_through_ties`` shows a 44-token forward differing from
its own 40-token prefix, and the difference gone once its top-k breaks ties by position). The
engine's definition breaks ties to the lower position. So:

* transformers is the oracle for prompts of at most ``index_topk`` tokens followed by decode
  steps (each step selects in its last row only, over all earlier keys), with enough indexer
  heads (16) that exact ties at the k-th score do not occur;
* longer prompts are checked against the engine's own chunked and token-by-token runs and
  against transformers with its indexer's top-k made tie-stable (the definition exactly).
"""
import contextlib
import json

import pytest
import torch

from blitzllm import LLM, SamplingParams
from blitzllm.config import ModelConfig
from blitzllm.loader.source import PRESET_DIR
from tests.models.test_deepseek_v3 import TINY_DS, _add_mtp_weights, make_tiny_deepseek

TINY_V32 = dict(TINY_DS, index_topk=8, index_n_heads=16, index_head_dim=16, n_shared_experts=1)
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=5)


def make_tiny_v32(path, seed=0, **overrides):
    """A random DeepSeek-V3.2 written with save_pretrained; random correction biases."""
    return make_tiny_deepseek(path, seed, arch="DeepseekV32", base=TINY_V32, **overrides)


def _prompts(lengths, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 320, (n,), generator=g).tolist() for n in lengths]


@contextlib.contextmanager
def stable_topk():
    """Inside: transformers' indexer picks its top-k with ties to the lower position (a stable
    descending sort), which makes it the definition for every row of a forward."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as md
    orig = md.DeepseekV32Indexer.forward

    def forward(self, *args, **kwargs):
        plain = torch.Tensor.topk

        def topk(x, k, dim=-1, largest=True, sorted=True):
            assert largest and dim == -1
            order = torch.sort(x, dim=-1, descending=True, stable=True)
            return torch.return_types.topk((order.values[..., :k], order.indices[..., :k]))
        torch.Tensor.topk = topk
        try:
            return orig(self, *args, **kwargs)
        finally:
            torch.Tensor.topk = plain
    md.DeepseekV32Indexer.forward = forward
    try:
        yield
    finally:
        md.DeepseekV32Indexer.forward = orig


def hf_decode(hf, prompt, n):
    """transformers' greedy tokens and each step's logprobs [n, V], every step a decode step."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float().log_softmax(-1)


def engine_logits(llm, prompt, chunk):
    """The engine's logits [len, V] at every position of ``prompt``, computed ``chunk`` tokens a
    forward over the paged caches (1: token by token, each a decode step). A fresh engine."""
    runner = llm.engine.runner
    table = list(range(-(-len(prompt) // runner.cache_cfg.block_size)))
    out = []
    for s in range(0, len(prompt), chunk):
        e = min(len(prompt), s + chunk)
        out.append(runner.score([(prompt[s:e], s, e)], [table], [0], [e - s]))
    return torch.cat(out).float()


def _all_free(llm):
    s = llm.stats()
    return s["kv_blocks_free"] == s["kv_blocks_total"]


def _check_matches(llm, hf, prompts, n=48):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0))
    for prompt, out in zip(prompts, outs):
        tokens, lp = hf_decode(hf, prompt, n)
        assert out.token_ids == tokens
        ours = torch.tensor([d[t] for d, t in zip(out.logprobs, out.token_ids)])
        torch.testing.assert_close(ours, lp[torch.arange(n), torch.tensor(tokens)], atol=1e-4, rtol=1e-4)
    return outs


@pytest.mark.parametrize("variant", [dict(), dict(index_topk=16, rope_parameters=dict(rope_type="default",
                                                                                      rope_theta=10000.0))])
def test_tiny_v32_matches_transformers(variant, tmp_path):
    """Prompts up to index_topk tokens, batched, then 48 decode steps well past index_topk: the
    greedy tokens and every step's logprob equal transformers'."""
    hf = make_tiny_v32(tmp_path, seed=1, **variant)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=64)
    topk = variant.get("index_topk", 8)
    outs = _check_matches(llm, hf, _prompts((1, 5, topk - 1, topk)))
    assert len({t for o in outs for t in o.token_ids}) > 8  # not a degenerate constant output
    assert _all_free(llm)


@pytest.mark.parametrize("types", [["full"] * 3, ["full", "shared", "shared"]])
def test_glm5_matches_transformers(tmp_path, types):
    """GLM-5 (GlmMoeDsaForCausalLM) on the same code: its indexer's interleaved rotary pairs and
    "shared" layers that attend to the last full layer's selection (no indexer of their own):
    transformers' tokens and step logprobs as above, and on prompts past index_topk one-shot
    prefill and token-by-token decode give the same logits."""
    hf = make_tiny_deepseek(tmp_path, 3, arch="GlmMoeDsa", base=TINY_V32, indexer_types=types)
    assert (hf.model.layers[1].self_attn.indexer is None) == (types[1] == "shared")
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=64)
    attn = llm.engine.runner.model.model.layers[1].self_attn
    assert attn.ix.interleave and (attn.indexer is None) == (types[1] == "shared")
    _check_matches(llm, hf, _prompts((1, 8), seed=9), n=32)
    prompt = _prompts((30,), seed=10)[0]
    one, each = (engine_logits(LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=16, block_size=4),
                               prompt, chunk) for chunk in (30, 1))
    torch.testing.assert_close(each, one, atol=1e-4, rtol=1e-4)


def test_oracle_noncausal_only_through_ties(tmp_path):
    """The evidence for the module docstring: with 2 indexer heads (ties at score 0 common),
    transformers' logits at position 39 of a 44-token forward differ from those of the same
    40-token prefix; with its top-k made tie-stable they agree. Our engine agrees with the
    tie-stable transformers on both."""
    hf = make_tiny_v32(tmp_path, seed=0, index_n_heads=2)
    ids = torch.tensor(_prompts((44,), seed=11))
    with torch.no_grad():
        plain = (hf(ids).logits[0, 39] - hf(ids[:, :40]).logits[0, 39]).abs().max()
        with stable_topk():
            full, prefix = hf(ids).logits[0], hf(ids[:, :40]).logits[0]
    assert plain > 0.1
    torch.testing.assert_close(full[:40], prefix, atol=1e-5, rtol=1e-5)
    ours = engine_logits(LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=16), ids[0].tolist(), 44)
    torch.testing.assert_close(ours, full, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("v32-long")
    return path, make_tiny_v32(path, seed=2)


@pytest.mark.parametrize("logits_bytes", [None, 4 * 48 * 5])
def test_long_prompts_prefill_chunks_and_decode_agree(long_ckpt, logits_bytes, monkeypatch):
    """Prompts 4x index_topk and more: the logits at every prompt position from one-shot prefill,
    7-token chunks and token-by-token decode agree (1e-4), and equal the definition's
    (transformers with a tie-stable top-k); ``logits_bytes``: the layer's query rows in chunks
    of 5 (a long prompt's bounded indexer logits)."""
    from blitzllm.layers import sparse_mla
    if logits_bytes:
        monkeypatch.setattr(sparse_mla, "LOGITS_BYTES", logits_bytes)
    path, hf = long_ckpt
    for prompt in _prompts((32, 45), seed=5):
        with torch.no_grad(), stable_topk():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        for chunk in (len(prompt), 7, 1):
            got = engine_logits(LLM(str(path), device="cpu", dtype="float32", kv_cache_blocks=16, block_size=4),
                                prompt, chunk)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=f"chunk {chunk}")


def test_long_prompts_greedy_same_in_every_mode(long_ckpt):
    """Batched long prompts: one-shot prefill, chunked prefill and token-by-token prompts give the
    same greedy tokens and logprobs, equal to the tie-stable transformers' greedy decode."""
    path, hf = long_ckpt
    prompts = _prompts((32, 45, 9), seed=6)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    runs = []
    for budget in (256, 7, 1):
        llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_blocks=64, block_size=4,
                  max_num_batched_tokens=budget)
        runs.append(llm.generate(prompts, params))
        assert _all_free(llm)
    for outs in runs[1:]:
        for a, b in zip(runs[0], outs):
            assert a.token_ids == b.token_ids
            for da, db in zip(a.logprobs, b.logprobs):
                assert da.keys() == db.keys()
                torch.testing.assert_close(torch.tensor(list(db.values())), torch.tensor(list(da.values())),
                                           atol=1e-4, rtol=1e-4)
    with stable_topk():
        for prompt, out in zip(prompts, runs[0]):
            assert out.token_ids == hf_decode(hf, prompt, 16)[0]


def test_preemption_and_prefix_cache_keep_greedy_output(long_ckpt):
    path, _ = long_ckpt
    prompts = _prompts((30, 41, 12, 35), seed=8)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(path), device="cpu", dtype="float32", kv_cache_blocks=96,
                                     block_size=4, enable_prefix_caching=False).generate(prompts, params)]
    # 24 blocks x 4 tokens: far less than the batch's ~200 tokens at once
    small = LLM(str(path), device="cpu", dtype="float32", kv_cache_blocks=24, block_size=4, max_model_len=64)
    assert [o.token_ids for o in small.generate(prompts, params)] == want
    assert small.stats()["preemptions"] > 0 and _all_free(small)
    cached = LLM(str(path), device="cpu", dtype="float32", kv_cache_blocks=96, block_size=4)
    first = [o.token_ids for o in cached.generate(prompts, params)]
    again = [o.token_ids for o in cached.generate([p + [5, 6] for p in prompts[:2]] + prompts, params)]
    assert cached.stats()["prefix_cache_hit_tokens"] > 100
    assert first == want and again[2:] == want
    fresh = LLM(str(path), device="cpu", dtype="float32", kv_cache_blocks=96, block_size=4,
                enable_prefix_caching=False)
    assert again[:2] == [o.token_ids for o in fresh.generate([p + [5, 6] for p in prompts[:2]], params)]
    assert _all_free(cached)


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    """(folder, transformers model, MTP tensors): a V3.2 checkpoint with an MTP layer (indexer included)."""
    path = tmp_path_factory.mktemp("v32-mtp")
    hf = make_tiny_v32(path, seed=4, num_hidden_layers=2)
    extra = _add_mtp_weights(path, hf)
    cfg = json.loads((path / "config.json").read_text())  # (transformers' V3.2 config has no MTP key)
    (path / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=1)))
    return path, hf, extra


MTP_KW = dict(device="cpu", dtype="float32", kv_cache_blocks=96, block_size=4)


def test_mtp_speculation_keeps_greedy_output(mtp_ckpt):
    """MTP drafts (the MTP layer with its own indexer) verified by the sparse target, and drafts of
    every acceptance length (a proposer that knows the answer and gets one token wrong): greedy
    output equals plain greedy output past index_topk, chunked prefill included; no leaks."""
    from tests.models.test_qwen3_next import _OracleDrafts
    path = mtp_ckpt[0]
    prompts = _prompts((3, 20, 33), seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(path), **MTP_KW).generate(prompts, params)]
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    llm = LLM(str(path), **MTP_KW, max_num_batched_tokens=16, speculative_config=spec)
    assert type(llm.engine.runner.model.mtp.layers[0].self_attn).__name__ == "SparseMLAttention"
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.stats()["spec_draft_tokens"] > 0 and _all_free(llm)
    llm.engine.spec.proposer = _OracleDrafts({tuple(p): w for p, w in zip(prompts, want)})
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    st = llm.stats()
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"] and _all_free(llm)


def test_mtp_drafts_match_transformers_reference(mtp_ckpt, monkeypatch):
    """Each proposal equals the drafts of transformers' V3.2 decoder layer loaded with the MTP
    weights (its indexer's top-k tie-stable), past index_topk, where the reference's top two
    logits are not a near tie."""
    from tests.engine.test_mtp import check_drafts, record_proposals
    path, hf, extra = mtp_ckpt
    seen = record_proposals(monkeypatch)
    llm = LLM(str(path), **MTP_KW, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    llm.generate(_prompts((5, 12), seed=8), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert len(seen) >= 4 and max(len(ids) for ids, _ in seen) > 2 * TINY_V32["index_topk"]
    with stable_topk():
        assert check_drafts(hf, extra, seen, arch="DeepseekV32") >= len(seen)


def test_cache_holds_latent_and_indexer_keys(tmp_path):
    make_tiny_v32(tmp_path, seed=3, num_hidden_layers=2)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=8)
    for latent, keys in llm.engine.runner.kv_caches:
        assert latent.shape == (8, 16, 1, 40) and keys.shape == (8, 16, 1, 16)
    cfg = llm.engine.model_config
    assert (cfg.index_head_dim, cfg.index_topk) == (16, 8) and cfg.kv_bytes_per_token(4) == 2 * (40 + 16) * 4
    from blitzllm.bench.roofline import kv_bytes_per_step  # a decode step reads every key, the top 8 latents
    assert kv_bytes_per_step(cfg, [5, 30], 4) == 2 * ((5 + 30) * 16 + (5 + 8) * 40) * 4
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert attn.indexer.k_norm.weight.dtype == attn.indexer.weights_proj.weight.dtype == torch.float32


def test_preset_config_and_meta_build():
    """The shipped preset: DeepSeek-V3's shape plus the indexer (64 heads of 128, top 2048); a
    num_layers override builds on the meta device."""
    from blitzllm.models.deepseek_v32 import DeepseekV32ForCausalLM
    hf_cfg = json.loads((PRESET_DIR / "deepseek-v3.2.json").read_text())
    cfg = ModelConfig.from_hf(hf_cfg, num_layers=4)
    assert (cfg.architecture, cfg.num_layers, cfg.kv_cache_entry, cfg.index_head_dim) == \
        ("DeepseekV32ForCausalLM", 4, (1, 1, 576), 128)
    assert cfg.kv_bytes_per_token(2) == 4 * (576 + 128) * 2
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(cfg)
    attn = model.model.layers[3].self_attn
    assert (attn.ix.n_heads, attn.ix.head_dim, attn.ix.topk, attn.ix.interleave) == (64, 128, 2048, False)
    assert attn.fused_qkv_a_proj.shard_sizes == [1536, 576, 128]
    assert attn.fused_q_b_proj.shard_sizes == [128 * 192, 64 * 128]
    assert model.args.num_mtp_layers == 1
