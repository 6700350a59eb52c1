"""MTP speculation (``{"method": "mtp"}``) on the hybrid models: tiny Qwen3-Next, Qwen3.5, Qwen3.5-MoE
and multimodal Qwen3.5-MoE checkpoints (``test_qwen3_next.make_hybrid_checkpoint``) with ``mtp.*``
tensors in the published layout (``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``,
``layers.0.*`` in the checkpoint's own format for a full-attention layer, ``norm``).

- the MTP tensors load, and the engine's drafts equal a reference built from transformers' decoder
  layer holding the same weights (the target's final-normed hidden states, (1 + w) norms, fc);
- greedy output with MTP speculation (k = 1 and 2, prompts batched, chunked prefill) equals
  transformers' greedy output, with drafts rejected (a random MTP head: the GDN states rolled back)
  and, the head's drafts replaced by the answer with one token wrong, of every acceptance length;
- preemption (a KV and state pool too small) and abort: no KV block or state slot left over; the
  KV budget counts the MTP layer's pages; dummy weights; a checkpoint without MTP tensors.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from blitzllm import LLM, SamplingParams
from blitzllm.spec import mtp as mtp_mod
from tests.conftest import hf_greedy
from tests.models.test_qwen3_next import ARCHS, assert_no_leaks, check_generate, make_hybrid_checkpoint

KW = dict(device="cpu", dtype="float32")
MTP_FROM = 1   # the full-attention layer whose checkpoint format (and, from a second model, weights) the MTP layer takes


def _text(hf):
    return hf.model.language_model if hasattr(hf.model, "language_model") else hf.model


def add_mtp_weights(arch: str, path, tmp, seed: int) -> tuple:
    """Write ``mtp.safetensors`` beside the checkpoint: layer MTP_FROM of a second random model of
    the same config as ``mtp.layers.0.*`` (its own file format), random fc and norms. Returns
    (that second model's transformers layer, the extra tensors by name)."""
    other = make_hybrid_checkpoint(arch, tmp, seed=seed)
    prefix = "model.language_model." if arch == "qwen3_5_moe" else "model."
    layer_prefix = f"{prefix}layers.{MTP_FROM}."
    tensors = {"mtp.layers.0." + k[len(layer_prefix):]: v.contiguous()
               for k, v in load_file(str(tmp / "model.safetensors")).items() if k.startswith(layer_prefix)}
    g = torch.Generator().manual_seed(seed)
    h = _text(other).config.hidden_size
    extra = {"mtp.fc.weight": torch.randn(h, 2 * h, generator=g) * (2 * h) ** -0.5}
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        extra[f"mtp.{n}.weight"] = torch.randn(h, generator=g) * 0.3
    save_file({**tensors, **extra}, str(path / "mtp.safetensors"))
    return _text(other).layers[MTP_FROM], extra


@pytest.fixture(scope="module", params=ARCHS)
def mtp_checkpoint(request, tmp_path_factory):
    arch = request.param
    path = tmp_path_factory.mktemp(arch)
    hf = make_hybrid_checkpoint(arch, path, seed=ARCHS.index(arch))
    layer, extra = add_mtp_weights(arch, path, tmp_path_factory.mktemp(arch + "-other"), seed=40 + ARCHS.index(arch))
    return arch, path, hf, layer, extra


def _prompts(lengths=(1, 6, 19, 33), seed: int = 5) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in lengths]


def reference_drafts(hf, layer, extra: dict, ids: list, k: int) -> tuple:
    """k greedy MTP drafts after ``ids`` from transformers: the target's final-normed hidden
    states h_t, x_t = fc([norm_e(embed(ids[t + 1])) | norm_h(h_t)]), transformers' decoder layer
    over x (causal), norm, the target's lm_head; the module's own output and draft fed back for
    each further step. Returns (drafts, top-2 logit margins)."""
    text = _text(hf)
    eps = text.config.rms_norm_eps

    def norm(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + extra[f"mtp.{name}.weight"])

    def inp(token, hid):
        e = text.embed_tokens.weight[token]
        return torch.cat([norm(e, "pre_fc_norm_embedding"), norm(hid, "pre_fc_norm_hidden")]) @ extra["mtp.fc.weight"].t()

    with torch.no_grad():
        h = text(torch.tensor([ids])).last_hidden_state[0]
        xs = [inp(ids[t + 1], h[t]) for t in range(len(ids) - 1)]
        drafts, margins = [], []
        for _ in range(k):
            x = torch.stack(xs)[None]
            pos = torch.arange(x.shape[1])[None]
            mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
            out = layer(x, position_embeddings=text.rotary_emb(x, pos), attention_mask=mask, position_ids=pos)
            o = norm((out[0] if isinstance(out, tuple) else out)[0, -1], "norm")
            logits = hf.lm_head(o)
            top = logits.topk(2).values
            drafts.append(int(logits.argmax()))
            margins.append(float(top[0] - top[1]))
            xs.append(inp(drafts[-1], o))
    return drafts, margins


def _record(monkeypatch, replace=None) -> list:
    """A list that collects (the request's tokens, the head's drafts) of every MTP proposal from
    now on; ``replace(request, drafts)``: what the engine gets instead."""
    seen = []
    orig = mtp_mod.PagedMTPProposer._draft

    def recording(self, reqs, limits):
        out = orig(self, reqs, limits)
        seen.extend((list(r.all_token_ids), list(d)) for r, d in zip(reqs, out) if d)
        return [replace(r, d) if d and replace else d for r, d in zip(reqs, out)]

    monkeypatch.setattr(mtp_mod.PagedMTPProposer, "_draft", recording)
    return seen


def _check_drafts(hf, layer, extra, seen: list, arch: str) -> None:
    """Each recorded (tokens, drafts) equals ``reference_drafts`` up to the reference's first near tie."""
    checked = 0
    for ids, drafts in seen:
        ref, margins = reference_drafts(hf, layer, extra, ids, len(drafts))
        for j, (a, b, mg) in enumerate(zip(drafts, ref, margins)):
            if mg < 1e-4:
                break  # a near tie: later steps may differ legitimately
            assert a == b, (arch, ids, j, drafts, ref)
            checked += 1
    assert checked >= len(seen)


def test_mtp_weights_load_and_drafts_match_transformers(mtp_checkpoint, monkeypatch):
    """The checkpoint's mtp.* tensors load into the model's ``mtp`` (every one of them), and
    every proposal the engine made (its pages reused across steps, rejected drafts trimmed)
    equals the transformers reference's drafts up to the reference's first near tie."""
    arch, path, hf, layer, extra = mtp_checkpoint
    seen = _record(monkeypatch)
    llm = LLM(str(path), **KW, kv_cache_blocks=64, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    model = llm.engine.runner.model
    assert model.mtp is not None and len(model.mtp.layers) == 1
    model.check_mtp()
    llm.generate(_prompts((5, 12, 20), seed=8), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert len(seen) >= 6
    _check_drafts(hf, layer, extra, seen, arch)
    assert_no_leaks(llm)


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_greedy_equals_transformers(mtp_checkpoint, k):
    """Prompts of 1 to 33 tokens batched (and in 8-token chunks): transformers' greedy tokens
    and logprobs with MTP drafts, nearly all rejected by the target (the GDN states rolled back
    each time); every KV block and state slot back after."""
    _, path, hf, _, _ = mtp_checkpoint
    spec = {"method": "mtp", "num_speculative_tokens": k}
    for extra in ({}, {"max_num_batched_tokens": 8}):
        llm = LLM(str(path), **KW, kv_cache_blocks=64, speculative_config=spec, **extra)
        check_generate(llm, hf, _prompts(), n=12)
        st = llm.stats()
        assert st["spec_method"] == "mtp" and st["spec_draft_tokens"] > st["spec_accepted_tokens"]


@pytest.mark.parametrize("mtp_checkpoint", ["qwen3_next", "qwen3_5_moe"], indirect=True)  # (the layouts' extremes)
def test_mtp_accepted_drafts_keep_the_pages_right(mtp_checkpoint, monkeypatch):
    """The MTP head's drafts replaced, after it made them, by the greedy answer with one token
    wrong at a moving position: every acceptance length from 0 to k, so positions the target
    accepted several at a time get their entries written in the next call. The output stays
    transformers' greedy output, and the head's own drafts equal the reference's at every call
    (its pages reused and rewritten correctly after each acceptance and rollback)."""
    arch, path, hf, layer, extra = mtp_checkpoint
    prompts = _prompts((3, 11, 26), seed=13)
    answers = {tuple(p): hf_greedy(hf, p, 14) for p in prompts}
    calls = [0]

    def oracle(r, d):
        truth = answers[tuple(r.prompt_token_ids)][len(r.output_token_ids):][:len(d)]
        calls[0] += 1
        return [(t + 1) % 320 if j == calls[0] % (len(d) + 1) else t for j, t in enumerate(truth)]

    seen = _record(monkeypatch, oracle)
    llm = LLM(str(path), **KW, kv_cache_blocks=64, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    check_generate(llm, hf, prompts, n=14)
    st = llm.stats()
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"]
    assert all(0 < a < 1 for a in st["spec_acceptance_per_position"])
    _check_drafts(hf, layer, extra, seen, arch)


@pytest.mark.parametrize("mtp_checkpoint", ["qwen3_5_moe_text"], indirect=True)
def test_mtp_preemption_abort_and_kv_budget(mtp_checkpoint, monkeypatch):
    """A KV cache and a state pool too small for the load: requests preempted (their draft pages
    go with their blocks and are rewritten after the recompute: the drafts stay the reference's)
    and outputs unchanged; an aborted
    request gives back every block, the draft's reserved ones included; the KV budget of MTP
    speculation counts one attention layer more per block."""
    arch, path, hf, layer, extra = mtp_checkpoint
    from blitzllm.config import ModelConfig
    from blitzllm.engine import args as args_mod
    from blitzllm.engine.args import EngineArgs, plan_kv_blocks
    from blitzllm.engine.args import engine_state_layout
    from blitzllm.engine.state_cache import state_bytes_per_row
    from blitzllm.loader.source import resolve_model
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    seen = _record(monkeypatch)
    llm = LLM(str(path), **KW, kv_cache_blocks=8, max_num_seqs=3, speculative_config=spec)
    check_generate(llm, hf, _prompts((17, 40, 33, 25, 3), seed=9), n=16)
    st = llm.stats()
    assert st["preemptions"] > 0 and st["spec_draft_tokens"] > 0
    _check_drafts(hf, layer, extra, seen, arch)
    eng = llm.engine
    eng.add_request("a", _prompts((30,))[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert eng.abort_request("a")
    assert_no_leaks(llm)
    cfg = ModelConfig.from_hf(resolve_model(str(path)).hf_config)
    per_block = cfg.kv_bytes_per_token(4) * 16

    def blocks(speculative_config) -> int:   # in a budget of the states + 60 blocks of the two attention layers
        a = EngineArgs(str(path), max_num_seqs=64, speculative_config=speculative_config)
        budget = engine_state_layout(a, cfg).total * state_bytes_per_row(cfg, 4) + 60 * per_block
        monkeypatch.setattr(args_mod, "CPU_KV_BUDGET_BYTES", budget)
        return plan_kv_blocks(a, cfg, torch.float32, torch.device("cpu"))
    assert len(cfg.kv_layers) == 2
    assert blocks(dict(spec, method="ngram")) == 60 and blocks(spec) == 40

@pytest.mark.parametrize("mtp_checkpoint", ["qwen3_5_text"], indirect=True)
def test_mtp_prefix_cache_hit_takes_the_cached_pages(mtp_checkpoint, monkeypatch):
    """A second chat turn (the first turn's prompt and answer plus new tokens) hits the prefix
    cache for 32 tokens (the GDN state snapshot its prefill took: verify steps take none): it
    drafts from the MTP entries the first turn left in those blocks (it has no hidden states
    there), its drafts equal the reference's, its output transformers'. Without prefix caching
    it drafts from its own prefill, as does a first turn."""
    arch, path, hf, layer, extra = mtp_checkpoint
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    turn1 = _prompts((37,), seed=11)[0]
    for caching in (True, False):
        llm = LLM(str(path), **KW, kv_cache_blocks=64, enable_prefix_caching=caching, speculative_config=spec)
        answer = check_generate(llm, hf, [turn1], n=10)[0].token_ids
        seen = _record(monkeypatch)
        before = llm.stats()
        check_generate(llm, hf, [turn1 + answer + _prompts((9,), seed=12)[0]], n=8)
        st = llm.stats()
        assert st["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == (32 if caching else 0)
        assert st["spec_draft_tokens"] - before["spec_draft_tokens"] >= 6 and len(seen) >= 3
        _check_drafts(hf, layer, extra, seen, arch)


def test_mtp_dummy_weights_and_errors(tmp_path):
    """Dummy weights get a random MTP layer (the config's count, else one: a preset runs MTP;
    greedy output still the plain engine's); a checkpoint without mtp.* tensors, or with only
    part of them, is an error."""
    import json
    hf = make_hybrid_checkpoint("qwen3_5_text", tmp_path / "m", seed=31)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="needs a model with MTP layers"):
        LLM(str(tmp_path / "m"), **KW, kv_cache_blocks=32, speculative_config=spec)
    kw = dict(KW, kv_cache_blocks=32, load_format="dummy")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = _prompts((4, 9), seed=32)
    plain = LLM(str(tmp_path / "m"), **kw)
    assert plain.engine.runner.model.mtp is None  # (built only for MTP speculation)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(str(tmp_path / "m"), **kw, speculative_config=spec)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.stats()["spec_draft_tokens"] > 0 and len(llm.engine.runner.model.mtp.layers) == 1
    conf = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**conf, "mtp_num_hidden_layers": 2}))
    assert len(LLM(str(tmp_path / "m"), **kw, speculative_config=spec).engine.runner.model.mtp.layers) == 2
    add_mtp_weights("qwen3_5_text", tmp_path / "m", tmp_path / "o", seed=33)
    part = load_file(str(tmp_path / "m" / "mtp.safetensors"))
    del part["mtp.layers.0.self_attn.k_proj.weight"]
    save_file(part, str(tmp_path / "m" / "mtp.safetensors"))
    with pytest.raises(ValueError, match="missing weights: mtp.layers.0.self_attn.qkv_proj.weight"):
        LLM(str(tmp_path / "m"), **KW, kv_cache_blocks=32, speculative_config=spec)
    assert hf_greedy(hf, prompts[0], 2)  # (the checkpoint itself is a working model)



def test_mtp_layer_is_allocated_in_the_model_dtype(tmp_path):
    """A bf16 hybrid model's MTP layer is created in bf16 (never float32 first: a Qwen3.5-397B
    MoE MTP layer would be about 26 GB), its (1 + w) norms widened to fp32 after, as the model's."""
    from blitzllm.layers.norm import OffsetRMSNorm
    from tests.engine.test_mtp import FactoryDtypes
    make_hybrid_checkpoint("qwen3_5_moe_text", tmp_path / "m", seed=34)
    llm = LLM(str(tmp_path / "m"), device="cpu", dtype="bfloat16", kv_cache_blocks=32, load_format="dummy")
    with FactoryDtypes() as seen:
        mtp = llm.engine.runner.model._new_mtp(1)
    assert seen.dtypes == {torch.bfloat16} and torch.get_default_dtype() == torch.float32
    norms = {id(p) for m in mtp.modules() if isinstance(m, OffsetRMSNorm) for p in m.parameters(recurse=False)}
    assert norms and {p.dtype for p in mtp.parameters() if id(p) in norms} == {torch.float32}
    assert {p.dtype for p in mtp.parameters() if id(p) not in norms} == {torch.bfloat16}

@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_mtp_on_cuda(arch, tmp_path):
    """CUDA (skipped without a GPU): the MTP layer's paged attention on the Triton backend, fp32
    tiny checkpoints: greedy output with MTP (k = 1 and 3, batched, chunked) equals
    transformers', drafts made, nothing left allocated; then a bf16 preset (dummy weights, a
    random MTP layer, a few layers) runs MTP speculation to the end."""
    hf = make_hybrid_checkpoint(arch, tmp_path / "m", seed=51).to("cuda")
    add_mtp_weights(arch, tmp_path / "m", tmp_path / "o", seed=52)
    prompts = _prompts((1, 6, 19, 33), seed=53)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            want.append(hf.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, eos_token_id=None,
                                    pad_token_id=0, attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist())
    for k, extra in ((1, {}), (3, {"max_num_batched_tokens": 8})):
        llm = LLM(str(tmp_path / "m"), device="cuda", dtype="float32", kv_cache_blocks=64, max_num_seqs=4,
                  speculative_config={"method": "mtp", "num_speculative_tokens": k}, **extra)
        assert llm.engine.runner.backend.name == "triton"
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert llm.stats()["spec_draft_tokens"] > 0
        assert_no_leaks(llm)
    llm = LLM("preset:qwen3.5-4b", num_layers=8, device="cuda", dtype="bfloat16", kv_cache_blocks=256,
              max_num_seqs=4, max_model_len=1024, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [12] * len(prompts) and llm.stats()["spec_draft_tokens"] > 0
    assert_no_leaks(llm)
