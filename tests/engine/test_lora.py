"""Multi-LoRA (blitzllm/lora): each request's adapter gives the outputs of transformers on the
checkpoint with that adapter merged (fp32, greedy tokens identical, logprobs close), alone or
mixed in a batch with the base model and other adapters, through too few slots, past the prefix
cache; bad adapters are refused with a ValueError and leave the engine serving."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from blitzllm import LLM, LoRARequest, SamplingParams
from blitzllm.lora import LoRARequest as LoRARequestFromPackage
from tests.conftest import TINY, hf_greedy, hf_logprobs
from tests.lora_adapters import ALL, ATTN, make_adapter, merged_model

N = 10
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=3)


def _prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY["vocab_size"], (int(L),), generator=g).tolist()
            for L in torch.randint(lo, hi, (n,), generator=g)]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """name -> (LoRARequest, merged oracle) for a few adapters of the tiny Llama."""
    path, hf = tiny_llama
    root = tmp_path_factory.mktemp("loras")
    specs = {"attn": dict(targets=ATTN, r=8, seed=1), "all": dict(targets=ALL, r=8, seed=2),
             "rslora": dict(targets=ALL, r=4, alpha=8, rslora=True, seed=3), "mlp": dict(targets=ALL[4:], r=16, seed=4)}
    out = {}
    for i, (name, kw) in enumerate(specs.items()):
        make_adapter(root / name, hf, **kw)
        out[name] = (LoRARequest(name, i + 1, str(root / name)), merged_model(path, root / name))
    return out


def _llm(tiny_llama, **kw):
    kw.setdefault("max_loras", 2)
    return LLM(str(tiny_llama[0]), device="cpu", dtype="float32", kv_cache_blocks=128, enable_lora=True, **kw)


def _check(out, oracle, prompt):
    assert out.token_ids == hf_greedy(oracle, prompt, N)
    want = hf_logprobs(oracle, prompt, out.token_ids)
    got = torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.token_ids)])
    assert torch.allclose(got, want, atol=1e-4), (got, want)


def test_lora_request_is_vllms_class():
    assert LoRARequest is LoRARequestFromPackage
    r = LoRARequest("a", 1, "/x")
    assert (r.lora_name, r.lora_int_id, r.lora_path) == ("a", 1, "/x")
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")


@pytest.mark.parametrize("name", ["attn", "all", "rslora"])
def test_adapter_matches_the_merged_model(tiny_llama, adapters, name):
    lora, oracle = adapters[name]
    llm = _llm(tiny_llama, max_loras=1)
    prompts = _prompts(3, seed=hash(name) % 100)
    outs = llm.generate(prompts, GREEDY, lora_request=lora)
    for prompt, out in zip(prompts, outs):
        _check(out, oracle, prompt)
    # the adapter changed the model: the base model's tokens differ somewhere
    base = llm.generate(prompts, GREEDY)
    assert any(b.token_ids != o.token_ids for b, o in zip(base, outs))
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_mixed_batch_of_base_and_two_adapters(tiny_llama, adapters):
    """One generate call, max_loras=2: base rows, adapter rows and another adapter's rows in the
    same steps, each its own oracle's output; the base rows are the plain engine's."""
    (la, oa), (lb, ob) = adapters["attn"], adapters["all"]
    prompts = _prompts(6, seed=7)
    which = [None, la, lb, la, None, lb]
    llm = _llm(tiny_llama, max_loras=2)
    outs = llm.generate(prompts, GREEDY, lora_request=which)
    plain = LLM(str(tiny_llama[0]), device="cpu", dtype="float32", kv_cache_blocks=128)
    for prompt, lora, out in zip(prompts, which, outs):
        if lora is None:
            assert out.token_ids == plain.generate([prompt], GREEDY)[0].token_ids
            assert out.token_ids == hf_greedy(tiny_llama[1], prompt, N)
        else:
            _check(out, oa if lora is la else ob, prompt)


def test_one_slot_two_adapters_take_turns(tiny_llama, adapters):
    (la, oa), (lb, ob) = adapters["attn"], adapters["rslora"]
    prompts = _prompts(4, seed=11)
    which = [la, lb, la, lb]
    llm = _llm(tiny_llama, max_loras=1)
    outs = llm.generate(prompts, GREEDY, lora_request=which)
    for prompt, lora, out in zip(prompts, which, outs):
        _check(out, oa if lora is la else ob, prompt)
    assert llm.stats()["lora_slot_loads"] >= 2
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_prefix_cache_is_not_shared_across_adapters(tiny_llama, adapters):
    lora, oracle = adapters["all"]
    llm = _llm(tiny_llama)
    prompt = _prompts(1, seed=5, lo=50, hi=51)[0]
    base = llm.generate([prompt], GREEDY)[0]
    assert base.token_ids == hf_greedy(tiny_llama[1], prompt, N)
    first = llm.generate([prompt], GREEDY, lora_request=lora)[0]
    assert first.num_cached_tokens == 0   # the base model's blocks are not the adapter's
    _check(first, oracle, prompt)
    again = llm.generate([prompt], GREEDY, lora_request=lora)[0]
    assert again.num_cached_tokens >= 48  # the adapter's own blocks are
    assert again.token_ids == first.token_ids
    other = llm.generate([prompt], GREEDY, lora_request=adapters["attn"][0])[0]
    assert other.num_cached_tokens == 0
    _check(other, adapters["attn"][1], prompt)


def test_lru_eviction_and_reload(tiny_llama, adapters):
    """Three adapters through two slots, one after another: the least recently used slot goes."""
    llm = _llm(tiny_llama, max_loras=2)
    prompt = _prompts(1, seed=9)[0]
    order = ["attn", "all", "mlp", "attn", "mlp"]
    for name in order:
        lora, oracle = adapters[name]
        _check(llm.generate([prompt], GREEDY, lora_request=lora)[0], oracle, prompt)
    # attn, all loaded; mlp evicts attn; attn evicts all (mlp used last); mlp is still in its slot
    assert llm.stats()["lora_slot_loads"] == 4
    assert llm.stats()["lora_slots_used"] == 2


def _bad(root, hf, name, **kw):
    make_adapter(root / name, hf, **kw)
    return str(root / name)


def _retarget(path, targets):
    cfg_path = os.path.join(path, "adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    with open(cfg_path, "w") as f:
        json.dump(dict(cfg, target_modules=targets), f)
    return path


def test_bad_adapters_are_refused_and_the_engine_keeps_serving(tiny_llama, adapters, tmp_path):
    hf = tiny_llama[1]
    llm = _llm(tiny_llama, max_lora_rank=8)
    missing = tmp_path / "no-weights"
    _bad(tmp_path, hf, "no-weights", targets=ATTN)
    os.remove(missing / "adapter_model.safetensors")
    emb = _retarget(_bad(tmp_path, hf, "emb", targets=ATTN), ATTN + ["embed_tokens"])
    lm_head = _retarget(_bad(tmp_path, hf, "lmhead", targets=ATTN), ["lm_head"])
    shape = _bad(tmp_path, hf, "shape", targets=ATTN, r=8)
    with open(os.path.join(shape, "adapter_config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(shape, "adapter_config.json"), "w") as f:
        json.dump(dict(cfg, r=4), f)   # (its tensors are of rank 8)
    corrupt = _bad(tmp_path, hf, "corrupt", targets=ATTN)
    with open(os.path.join(corrupt, "adapter_model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    cases = [
        (_bad(tmp_path, hf, "big", targets=ATTN, r=16), "larger than max_lora_rank 8"),
        (shape, "the model needs"),
        (corrupt, "unreadable"),
        (emb, "embed_tokens"),
        (lm_head, "lm_head"),
        (_bad(tmp_path, hf, "dora", targets=ATTN, use_dora=True), "DoRA"),
        (_bad(tmp_path, hf, "mts", targets=ATTN, modules_to_save=["lm_head"]), "modules_to_save"),
        (_bad(tmp_path, hf, "bias", targets=ATTN, bias="all"), "bias"),
        (str(missing), "no adapter_model.safetensors"),
        (str(tmp_path / "nowhere"), "not a local folder"),
    ]
    prompts = _prompts(2, seed=3)
    good, oracle = adapters["attn"]
    for i, (path, msg) in enumerate(cases):
        with pytest.raises(ValueError, match=msg):
            # the good request is added first and taken back when the bad one fails
            llm.generate(prompts, GREEDY, lora_request=[good, LoRARequest(f"bad{i}", 100 + i, path)])
        assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
        assert not llm.engine.has_unfinished()
    _check(llm.generate(prompts[:1], GREEDY, lora_request=good)[0], oracle, prompts[0])
    with pytest.raises(ValueError, match="LoRARequest"):
        llm.generate(prompts[:1], GREEDY, lora_request="attn")


def _spec_config(method: str, tiny_llama, tmp_path_factory) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    if method == "draft_model":   # (the base checkpoint drafts: the adapters' rows accept less)
        return {"method": "draft_model", "num_speculative_tokens": 3, "model": str(tiny_llama[0])}
    from blitzllm.spec.eagle3 import Eagle3Head
    plain = LLM(str(tiny_llama[0]), device="cpu", dtype="float32", kv_cache_blocks=16)
    torch.manual_seed(0)   # (an untrained head from the target's own layers and embeddings)
    head = Eagle3Head.from_target(plain.engine.runner.model, plain.engine.model_config, [0, 1, 1])
    path = str(tmp_path_factory.mktemp("eagle3") / "head")
    head.save(path)
    return {"method": "eagle3", "num_speculative_tokens": 2, "model": path}


@pytest.mark.parametrize("device,method", [("cpu", "ngram"), ("cpu", "draft_model"), ("cpu", "eagle3"),
                                           pytest.param("cuda", "ngram", marks=pytest.mark.gpu)])
def test_speculation_under_adapters(tiny_llama, adapters, tmp_path_factory, device, method):
    """Speculative decoding with LoRA: the verify steps run under each row's adapter (on CUDA as
    decode rows through the graphs, the rows' slots repeated per sequence), so a batch mixing the
    base model and two adapters gives each merged model's greedy tokens (and logprobs), whatever
    proposes the drafts (prompt lookup, the base checkpoint as a draft model, or an EAGLE-3 head
    fed the adapters' hidden states); drafts proposed and accepted; every block back."""
    (la, oa), (lb, ob) = adapters["attn"], adapters["all"]
    llm = LLM(str(tiny_llama[0]), device=device, dtype="float32", kv_cache_blocks=128, enable_lora=True,
              max_loras=2, speculative_config=_spec_config(method, tiny_llama, tmp_path_factory))
    assert (llm.engine.runner.graphs is not None) == (device == "cuda")
    base = [5, 6, 7, 8, 9, 10, 11, 12]
    prompts = [base * 3, (base[::-1] + [40, 41]) * 3, base[2:] * 4]   # (repeats: the n-grams find drafts)
    long = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)   # (greedy settles into loops)
    outs = llm.generate(prompts, long, lora_request=[la, None, lb])
    for prompt, out, oracle in zip(prompts, outs, (oa, tiny_llama[1], ob)):
        assert out.token_ids == hf_greedy(oracle, prompt, 48)
    _check(llm.generate(prompts[:1], GREEDY, lora_request=la)[0], oa, prompts[0])   # (logprobs too)
    st = llm.stats()
    assert st["spec_draft_tokens"] > 0 and st["spec_accepted_tokens"] > 0, st
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_lora_refusals(tiny_llama, adapters):
    lora = adapters["attn"][0]
    plain = LLM(str(tiny_llama[0]), device="cpu", dtype="float32", kv_cache_blocks=32)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate([[5, 6, 7]], GREEDY, lora_request=lora)
    for bad in ({"max_loras": 0}, {"max_lora_rank": -1}, {"enable_lora": "yes"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LLM(str(tiny_llama[0]), device="cpu", **{"enable_lora": True, **bad})
    from blitzllm.lora import LoRAConfig
    from blitzllm.lora.manager import LoRAManager
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM"):
        LoRAManager(plain.engine.runner.model, "Qwen3MoeForCausalLM", LoRAConfig(), torch.device("cpu"), torch.float32)


@pytest.mark.gpu
def test_adapters_in_cuda_graphs_match_the_merged_models(tiny_llama, adapters):
    """Adapters on CUDA (fp32) with the decode CUDA graphs captured (the rows' slots a graph
    input, the look-ahead step on): one adapter against transformers with it merged, on the
    GPU; then a mixed batch (base rows and two adapters' rows in the same graph replays) gives
    each row its own oracle's tokens, and the eager engine's."""
    lora, oracle = adapters["all"]
    oracle = copy.deepcopy(oracle).to("cuda")   # (the fixture's CPU model stays for the other tests)
    kw = dict(device="cuda", dtype="float32", kv_cache_blocks=64, max_num_seqs=8, enable_lora=True, max_loras=2)
    llm = LLM(str(tiny_llama[0]), **kw)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.lora is not None
    prompts = _prompts(3, seed=21)
    outs = llm.generate(prompts, GREEDY, lora_request=lora)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            want = oracle.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False, eos_token_id=None,
                                   pad_token_id=0, attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
            first = torch.log_softmax(oracle(ids).logits[0, -1].float(), -1)
        assert out.token_ids == want
        for tok, lp in out.logprobs[0].items():
            assert abs(lp - first[tok].item()) < 1e-3
    (la, oa), (lb, ob) = adapters["attn"], adapters["all"]
    prompts = _prompts(6, seed=7)
    which = [None, la, lb, la, None, lb]
    graphs = [o.token_ids for o in llm.generate(prompts, GREEDY, lora_request=which)]
    eager = LLM(str(tiny_llama[0]), **kw, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    assert graphs == [o.token_ids for o in eager.generate(prompts, GREEDY, lora_request=which)]
    for prompt, lo, got in zip(prompts, which, graphs):
        if lo is not None:
            assert got == hf_greedy(oa if lo is la else ob, prompt, N)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


@pytest.mark.gpu
def test_decode_batches_past_the_kernel_rows_match_the_merged_models(tiny_llama, adapters, monkeypatch):
    """CUDA graphs at batches on both sides of kernels/lora's KERNEL_MAX_ROWS (decode rows up to it
    take the shrink / expand kernels, more the one-GEMM form with the one-hot mask; the graphs'
    capture runs both): 20 prompts, base rows and two adapters mixed, each row gets its merged
    model's greedy tokens."""
    from blitzllm.kernels.lora import KERNEL_MAX_ROWS
    from blitzllm.lora import manager
    calls = {"kernels": set(), "gemm": set()}
    for name, form in (("lora_add_triton", "kernels"), ("reference_lora_add", "gemm")):
        fn = getattr(manager, name)
        monkeypatch.setattr(manager, name, lambda y, *a, _fn=fn, _form=form, **kw: calls[_form].add(y.shape[0])
                            or _fn(y, *a, **kw))
    (la, oa), (lb, ob) = adapters["attn"], adapters["all"]
    llm = LLM(str(tiny_llama[0]), device="cuda", dtype="float32", kv_cache_blocks=128, max_num_seqs=32,
              enable_lora=True, max_loras=2)
    assert max(calls["kernels"]) == KERNEL_MAX_ROWS and min(calls["gemm"]) == 2 * KERNEL_MAX_ROWS, calls
    prompts = _prompts(20, seed=17)
    which = [(None, la, lb)[i % 3] for i in range(20)]
    assert len(prompts) > KERNEL_MAX_ROWS
    for n in (KERNEL_MAX_ROWS, 20):
        got = [o.token_ids for o in llm.generate(prompts[:n], GREEDY, lora_request=which[:n])]
        for prompt, lo, ids in zip(prompts, which, got):
            assert ids == hf_greedy(tiny_llama[1] if lo is None else (oa if lo is la else ob), prompt, N)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_the_benchs_random_adapter_matches_its_merged_model(tiny_llama, tmp_path):
    """``write_random_adapter`` (``blitz bench latency --lora-rank``) writes a PEFT adapter on
    every wrapped projection that the engine serves as transformers does with it merged."""
    from blitzllm.lora.adapter import write_random_adapter
    llm = _llm(tiny_llama, max_loras=1)
    write_random_adapter(llm.engine.lora.modules, str(tmp_path / "r"), 4, seed=5, std=0.2)
    oracle = merged_model(tiny_llama[0], tmp_path / "r")
    prompts = _prompts(2, seed=33)
    outs = llm.generate(prompts, GREEDY, lora_request=LoRARequest("r", 9, str(tmp_path / "r")))
    for prompt, out in zip(prompts, outs):
        _check(out, oracle, prompt)
    assert any(a.token_ids != b.token_ids for a, b in zip(outs, llm.generate(prompts, GREEDY)))


def test_prompt_logprobs_under_an_adapter(tiny_llama, adapters):
    """The prefill's prompt logprobs (every prompt position scored in the same forward) are the
    merged model's."""
    lora, oracle = adapters["all"]
    llm = _llm(tiny_llama)
    prompt = _prompts(1, seed=13, lo=20, hi=21)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       lora_request=lora)[0]
    with torch.no_grad():
        want = oracle(torch.tensor([prompt])).logits[0].log_softmax(-1)
    got = torch.tensor([d[t] for d, t in zip(out.prompt_logprobs[1:], prompt[1:])])
    assert torch.allclose(got, want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])], atol=1e-4)


def test_smollm2_chat_under_an_adapter(smollm2_hf, tmp_path):
    """The real model (fp32, as transformers runs it): LLM.chat under an adapter is the merged
    model's greedy answer; on its GGUF grid (the CPU default) the adapter runs too."""
    make_adapter(tmp_path / "smol", smollm2_hf, targets=ATTN + ["down_proj"], r=8, seed=5, std=0.1)
    oracle = merged_model(None, tmp_path / "smol", base=smollm2_hf)
    lora = LoRARequest("smol", 7, str(tmp_path / "smol"))
    llm = LLM("smollm2", dtype="float32", device="cpu", max_model_len=512, enable_lora=True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    out = llm.chat(messages, p, lora_request=lora)[0]
    ids = llm.apply_chat_template(messages)
    assert out.token_ids == hf_greedy(oracle, ids, 12)
    want = hf_logprobs(oracle, ids, out.token_ids)
    got = torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.token_ids)])
    assert torch.allclose(got, want, atol=1e-3)
    base = llm.chat(messages, p)[0]   # (the adapter moved the model)
    assert base.token_ids != out.token_ids or abs(base.logprobs[0][base.token_ids[0]] - got[0].item()) > 1e-2
    grid = LLM("smollm2", device="cpu", max_model_len=512, enable_lora=True)
    assert grid.engine.runner.model.model.layers[0].self_attn.qkv_proj.quant is not None
    assert len(grid.chat(messages, p, lora_request=lora)[0].token_ids) == 12


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_adapters_match_the_merged_model(arch, tmp_path):
    """Qwen2 (q/k/v biases beside the LoRA) and Qwen3 (q/k norms after it), all seven modules."""
    from tests.conftest import make_tiny_checkpoint
    hf = make_tiny_checkpoint(arch, tmp_path / "base", seed=6)
    make_adapter(tmp_path / "lora", hf, targets=ALL, r=8, seed=7)
    oracle = merged_model(tmp_path / "base", tmp_path / "lora")
    llm = LLM(str(tmp_path / "base"), device="cpu", dtype="float32", kv_cache_blocks=64, enable_lora=True)
    prompts = _prompts(2, seed=17)
    outs = llm.generate(prompts, GREEDY, lora_request=LoRARequest("q", 1, str(tmp_path / "lora")))
    for prompt, out in zip(prompts, outs):
        _check(out, oracle, prompt)


def test_beam_search_under_an_adapter(tiny_llama, adapters):
    """Beam width 1 is greedy decoding: under an adapter, the merged model's greedy tokens."""
    from blitzllm import BeamSearchParams
    lora, oracle = adapters["all"]
    llm = _llm(tiny_llama, max_loras=1)
    prompt = _prompts(1, seed=7)[0]
    best = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=N, ignore_eos=True),
                           lora_request=lora)[0].sequences[0]
    assert best.tokens[len(prompt):] == hf_greedy(oracle, prompt, N)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
