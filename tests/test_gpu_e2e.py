"""GPU end to end (skipped without CUDA). The oracle is independent of the fast path: an engine
built with the knob BLITZ_REFERENCE=1 runs every op on its torch reference (no Triton, no CUDA
graphs, the torch attention backend), on the same weights; one test compares with transformers
itself on a tiny checkpoint. Knobs are read when an engine is built, so a test sets them with
``monkeypatch.setenv`` before it builds one."""
import pytest
import torch

from blitzllm import LLM, SamplingParams
from tests.gpu_parity import BF16_TOL, assert_runs_agree

pytestmark = pytest.mark.gpu


def _prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (int(L),), generator=g).tolist()
            for L in torch.randint(1, 300, (n,), generator=g)]


def _reference(monkeypatch, model, **kw):
    """The forced-reference engine of ``model`` (its fast twin must have been built first)."""
    with monkeypatch.context() as m:
        m.setenv("BLITZ_REFERENCE", "1")
        llm = LLM(model, **kw)
    runner = llm.engine.runner
    assert runner.graphs is None and runner.backend.name == "torch" and runner.knobs.reference
    return llm


@pytest.mark.parametrize("preset,layers", [("qwen3-0.6b", 4), ("llama-3.1-8b", 2)])
def test_triton_graphs_match_the_reference_fp32(monkeypatch, preset, layers):
    """fp32: every Triton kernel + CUDA graphs (plain and chunked prefill mixed with decode, a
    2,500-token prompt through the SDPA prefill) gives the reference engine's greedy tokens."""
    kw = dict(num_layers=layers, device="cuda", dtype="float32", kv_cache_blocks=1024, max_num_seqs=16,
              max_model_len=4096)
    fast = LLM(f"preset:{preset}", **kw)
    assert fast.engine.runner.graphs is not None and fast.engine.runner.backend.name == "triton"
    prompts = _prompts(12, fast.engine.model_config.vocab_size)
    prompts.append((_prompts(1, fast.engine.model_config.vocab_size, seed=5)[0] * 40)[:2500])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [o.token_ids for o in fast.generate(prompts, params)]
    fast_chunked = LLM(f"preset:{preset}", max_num_batched_tokens=64, **kw)
    got_chunked = [o.token_ids for o in fast_chunked.generate(prompts, params)]
    del fast, fast_chunked
    want = [o.token_ids for o in _reference(monkeypatch, f"preset:{preset}", **kw).generate(prompts, params)]
    assert got == want
    assert got_chunked == want


@pytest.mark.parametrize("preset,layers", [("qwen3-0.6b", 4), ("llama-3.1-8b", 2), ("qwen3-30b-a3b", 2),
                                           ("minimax-m2", 2), ("deepseek-v3", 4)])
def test_bf16_fast_path_matches_the_reference(monkeypatch, preset, layers):
    """bf16, CUDA graphs, batches of 2 and 1 (the GEMV, GLU GEMV, TMA GEMV, fused decode
    attention, norm + router, direct MoE with its fp32 sums, MLA kernels): outputs agree with
    the reference engine's step by step (``tests/gpu_parity.py``)."""
    kw = dict(num_layers=layers, device="cuda", dtype="bfloat16", kv_cache_blocks=256, max_num_seqs=8,
              max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    fast = LLM(f"preset:{preset}", **kw)
    prompts = _prompts(2, fast.engine.model_config.vocab_size, seed=8)
    fast_outs = [o for p in (prompts, prompts[:1]) for o in fast.generate(p, params)]
    del fast
    torch.cuda.empty_cache()
    ref = _reference(monkeypatch, f"preset:{preset}", **kw)
    ref_outs = [o for p in (prompts, prompts[:1]) for o in ref.generate(p, params)]
    # the reference is the engine still alive (deepseek-v3's two engines do not fit together): where
    # the runs fork at a near tie, it restarts teacher-forced on the fast path's tokens
    assert_runs_agree(ref, prompts + prompts[:1], ref_outs, fast_outs, params, tol=BF16_TOL)


def test_greedy_tokens_and_logprobs_match_transformers_on_cuda(tmp_path):
    """A tiny Qwen3 checkpoint (save_pretrained, fp32) on CUDA with every kernel and CUDA graph:
    the greedy tokens of transformers' own generate, and the first token's logprobs within 1e-3."""
    from tests.conftest import TINY, make_tiny_checkpoint
    hf = make_tiny_checkpoint("qwen3", tmp_path, seed=3).to("cuda")
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_blocks=128, max_num_seqs=4)
    assert llm.engine.runner.graphs is not None
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist() for n in (1, 7, 30)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            want_ids = hf.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, eos_token_id=None,
                                   pad_token_id=0, attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
            want = torch.log_softmax(hf(ids).logits[0, -1].float(), -1)
        assert out.outputs[0].token_ids == want_ids
        for tok, lp in out.outputs[0].logprobs[0].items():
            assert abs(lp - want[tok].item()) < 1e-3


def test_spec_verify_through_decode_graphs_matches_plain(monkeypatch):
    """Speculative verify steps replay the decode CUDA graphs (one row per scored position):
    greedy output equals plain greedy output, fp32, with drafts accepted."""
    from blitzllm.runner import model_runner
    calls = []
    orig = model_runner.ModelRunner._score_as_decode_rows
    monkeypatch.setattr(model_runner.ModelRunner, "_score_as_decode_rows",
                        lambda self, *a: calls.append(1) or orig(self, *a))
    kw = dict(num_layers=4, device="cuda", dtype="float32", kv_cache_blocks=1024, max_num_seqs=8,
              max_model_len=2048)
    base = _prompts(6, 151936, seed=3)
    prompts = [p[:20] * 4 for p in base]   # repetitive prompts: prompt lookup finds drafts
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in LLM("preset:qwen3-0.6b", **kw).generate(prompts, params)]
    spec = LLM("preset:qwen3-0.6b", speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **kw)
    assert spec.engine.runner.graphs.buckets[-1] == 32
    got = [o.token_ids for o in spec.generate(prompts, params)]
    assert got == want
    s = spec.stats()
    assert calls and s["spec_draft_tokens"] > 0 and s["spec_accepted_tokens"] > 0
    assert spec.engine.kv.num_free_blocks == spec.engine.kv.num_blocks


@pytest.mark.parametrize("preset,layers", [("qwen3-30b-a3b", 2), ("qwen3-0.6b", 4), ("llama-3.1-8b", 2)])
def test_tma_gemv_decode_matches_fma_gemv(monkeypatch, preset, layers):
    """Decode with o_proj and qkv as the TMA GEMV (knob BLITZ_GEMV_TMA=1, the default on Hopper)
    against the FMA GEMV (=0): greedy tokens equal (bf16, batches of 2 and 1, CUDA graphs), the
    TMA GEMV ran and the decode plan marked the projections."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Hopper only")
    import blitzllm.kernels.gemv.gemv_tma as gemv_tma
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want, got, calls, llm = _knob_runs(monkeypatch, "BLITZ_GEMV_TMA", "0", "1", gemv_tma, "gemv_tma_triton",
                                       preset, layers, params, seed=8)
    layer = llm.engine.runner.model.model.layers[0]
    assert layer.self_attn.o_proj.tma_preload and layer.self_attn.qkv_proj.tma_preload
    assert calls and set(calls) <= {1, 2}
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def _knob_runs(monkeypatch, knob, off, on, module, launcher, preset, layers, params, seed):
    """Decode outputs (batches of 2 and 1, bf16, CUDA graphs) of an engine built with ``knob`` =
    off, then of one built with it = on with ``module.launcher`` counted: (outputs off, outputs
    on, the rows of each counted call, the second LLM)."""
    kw = dict(num_layers=layers, device="cuda", dtype="bfloat16", kv_cache_blocks=256, max_num_seqs=8,
              max_model_len=1024)
    monkeypatch.setenv(knob, off)
    base = LLM(f"preset:{preset}", **kw)
    prompts = _prompts(2, base.engine.model_config.vocab_size, seed=seed)
    want = [o for p in (prompts, prompts[:1]) for o in base.generate(p, params)]
    del base
    torch.cuda.empty_cache()
    monkeypatch.setenv(knob, on)
    calls = []
    orig = getattr(module, launcher)
    monkeypatch.setattr(module, launcher, lambda *a, **k: calls.append(a[0].shape[0]) or orig(*a, **k))
    llm = LLM(f"preset:{preset}", **kw)
    got = [o for p in (prompts, prompts[:1]) for o in llm.generate(p, params)]
    return want, got, calls, llm


def _fp8_round_trip_in_place(model, block) -> dict:
    """Each module of ``model`` that weight_dtype='fp8' quantizes (``quantize_fp8_weights``: every
    Linear with a weight but the output heads, every FusedMoE's experts) gets its weights
    quantized in blocks of ``block`` by its own ``quantize_fp8`` and widened back to its dtype, one
    module at a time: the quantizing is done on a deep copy of the module that shares its tensors
    (``quantize_fp8`` only reads them, and replaces them in the copy), each matrix (each expert's)
    is dequantized into the live weight, and the copy is freed. So the memory this takes beyond
    the model is one module's float8 weights and one matrix in fp32 (a whole-model copy, or
    deepseek-v3's experts dequantized at once, 28 GiB in fp32, did not fit an 80 GB card beside
    the engine). Returns {module name: its fp8_block}."""
    import copy

    import blitzllm.kernels.fp8_weights as fw
    from blitzllm.layers.linear import Linear
    from blitzllm.layers.moe import FusedMoE
    done = {}
    for name, mod in list(model.named_modules()):
        if isinstance(mod, Linear):
            if mod.weight is None or name.rsplit(".", 1)[-1] in ("lm_head", "head"):
                continue
            pairs = [("weight", "weight_scale_inv")]
        elif isinstance(mod, FusedMoE):
            pairs = [("w13", "w13_scale_inv"), ("w2", "w2_scale_inv")]
        else:
            continue
        twin = copy.deepcopy(mod, {id(t): t for t in (*mod.parameters(), *mod.buffers())})
        twin.quantize_fp8(block)
        with torch.no_grad():
            for weight, scale in pairs:
                live, q, s = (t.view(-1, *t.shape[-2:]) for t in (getattr(mod, weight), getattr(twin, weight),
                                                                  getattr(twin, scale)))
                for i in range(q.shape[0]):
                    live[i].copy_(fw.dequantize(q[i], s[i], twin.fp8_block, live.dtype))
        done[name] = twin.fp8_block
        del twin
    return done


@pytest.mark.parametrize("preset,layers", [("qwen3-30b-a3b", 2), ("minimax-m2", 2), ("deepseek-v3", 4),
                                           ("qwen3-0.6b", 4)])
def test_fp8_weights_match_their_dequantized_bf16_values(monkeypatch, preset, layers):
    """weight_dtype='fp8' on CUDA (the FP8 linear kernel, the MoE GEMMs with float8 experts, CUDA
    graphs; bf16 activations) against the default bf16 path on the same weights dequantized (each
    quantized and widened back in place, module by module, graphs kept): the FP8 kernels ran on
    exactly the modules widened back, and the outputs agree step by step (``tests/gpu_parity.py``)."""
    import blitzllm.kernels.fp8_weights as fw
    import blitzllm.kernels.moe.experts as fm
    kw = dict(num_layers=layers, device="cuda", dtype="bfloat16", kv_cache_blocks=256, max_num_seqs=8,
              max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    ref = LLM(f"preset:{preset}", **kw)
    # the block runner/build.py quantizes a checkpoint with no quantization_config in (the presets:
    # WEIGHT_BLOCK, scales not rounded to powers of two)
    widened = _fp8_round_trip_in_place(ref.engine.runner.model, fw.WEIGHT_BLOCK)
    prompts = _prompts(2, ref.engine.model_config.vocab_size, seed=21)
    want = [o for p in (prompts, prompts[:1]) for o in ref.generate(p, params)]
    del ref
    torch.cuda.empty_cache()
    linear_rows, moe_scaled = [], []
    orig_lin, orig_gg = fw.fp8_linear_triton, fm._grouped_gemm
    monkeypatch.setattr(fw, "fp8_linear_triton", lambda x, *a, **k: linear_rows.append(x.shape[0]) or orig_lin(x, *a, **k))
    monkeypatch.setattr(fm, "_grouped_gemm", lambda *a, **k: moe_scaled.append(k.get("scale") is not None)
                        or orig_gg(*a, **k))
    fp8 = LLM(f"preset:{preset}", weight_dtype="fp8", **kw)
    assert fp8.engine.runner.graphs is not None
    got = [o for p in (prompts, prompts[:1]) for o in fp8.generate(p, params)]
    assert linear_rows and (preset == "qwen3-0.6b" or (moe_scaled and all(moe_scaled)))
    assert {name: mod.fp8_block for name, mod in fp8.engine.runner.model.named_modules()
            if getattr(mod, "fp8_block", None) is not None} == widened
    # two bf16-activation engines with their own summation orders (the FP8 kernels against cuBLAS on
    # the same values): BF16_TOL, as for the bf16 fast path. Since the one-call SDPA MLA prefill
    # (25c4682) deepseek-v3 sits 3 logit steps (3/32) apart at step 12 on an H100, over TOL
    assert_runs_agree(fp8, prompts + prompts[:1], got, want, params, tol=BF16_TOL)


def test_mtp_speculation_matches_plain_greedy():
    """method 'mtp' on CUDA (preset:deepseek-v3, 2 dense layers, its dummy MTP layer an MoE
    one; bf16): the drafts ran and the outputs agree with the plain engine's step by step
    (``tests/gpu_parity.py``; verify rows run other shapes than plain decode)."""
    kw = dict(num_layers=2, device="cuda", dtype="bfloat16", kv_cache_blocks=256, max_num_seqs=8,
              max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    plain = LLM("preset:deepseek-v3", **kw)
    prompts = _prompts(2, plain.engine.model_config.vocab_size, seed=22)
    want = plain.generate(prompts, params)
    del plain
    torch.cuda.empty_cache()
    llm = LLM("preset:deepseek-v3", **kw, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    got = llm.generate(prompts, params)
    assert llm.stats()["spec_draft_tokens"] > 0
    assert_runs_agree(llm, prompts, got, want, params)


def test_structured_output_on_cuda():
    """A json_schema structured output on CUDA (CUDA graphs on; the constrained row skips the
    decode look-ahead) beside an unconstrained request, which keeps its tokens and logprobs (up to
    near ties, ``tests/gpu_parity.py``). The model is preset:qwen3-0.6b at 2 layers (dummy weights,
    its character-level tokenizer: nothing to install or download). The grammar holds whatever
    the weights, but a random model need not end its JSON: the schema bounds the string and the
    integer, and the request biases away whitespace (which JSON allows without bound between
    tokens), so the constrained output completes within ~30 tokens."""
    import json
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    llm = LLM("preset:qwen3-0.6b", num_layers=2, device="cuda", dtype="bfloat16", kv_cache_blocks=256,
              max_num_seqs=8, max_model_len=1024)
    assert llm.engine.runner.graphs is not None
    prompt = llm.apply_chat_template([{"role": "user", "content": "Describe a person as JSON with name and age."}])
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=5)
    alone = llm.generate([prompt], plain)[0]
    space = llm.engine.tokenizer.convert_tokens_to_ids([" ", "\n"])
    outs = llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=60, structured_output={
        "type": "json_schema", "schema": schema}, logit_bias={t: -100 for t in space}), plain])
    assert outs[0].finish_reason == "stop", outs[0].text   # (the grammar complete: only EOS was allowed)
    obj = json.loads(outs[0].text)
    assert list(obj) == ["name", "age"] and isinstance(obj["name"], str), obj
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool) and 0 <= obj["age"] <= 120, obj
    assert_runs_agree(llm, [prompt], outs[1:], [alone], plain)


def test_token_constraints_on_cuda():
    """allowed_token_ids, bad_words and truncate_prompt_tokens on CUDA with graphs on (a
    bad-words row skips the decode look-ahead; an allowed_token_ids row keeps it), fp32 so plain
    and speculative greedy runs agree exactly. The preset's tokenizer spells text by character, so
    the allowed set is ten letters' ids and the bad word two letters of that run's own output:
    every token in the set, no spelling of the word after, a truncated prompt answered as its kept
    tokens, and ngram speculation verifying through the same masks gives the plain engine's tokens."""
    kw = dict(num_layers=4, device="cuda", dtype="float32", kv_cache_blocks=512, max_num_seqs=8, max_model_len=1024)
    llm = LLM("preset:qwen3-0.6b", **kw)
    assert llm.engine.runner.graphs is not None
    tok = llm.engine.tokenizer
    prompts = [p[:20] * 4 for p in _prompts(4, 151936, seed=7)]
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    letters = base.clone(allowed_token_ids=tok.encode("abcdefghij", add_special_tokens=False))
    free = [o.token_ids for o in llm.generate(prompts, letters)]
    assert all(set(t) <= set(letters.allowed_token_ids) for t in free)
    word = tok.decode(free[0][2:4])
    spelled = [tok.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    assert spelled[0] == free[0][2:4]
    cases = [letters, letters.clone(bad_words=[word])]
    plain = [free, [o.token_ids for o in llm.generate(prompts, cases[1])]]
    assert not any(o[i:i + len(s)] == s for o in plain[1] for s in spelled for i in range(len(o)))
    assert all(set(t) <= set(letters.allowed_token_ids) for t in plain[1])
    cut = llm.generate(prompts, base.clone(truncate_prompt_tokens=9))
    assert [o.token_ids for o in cut] == [o.token_ids for o in llm.generate([p[-9:] for p in prompts], base)]
    assert all(o.prompt_token_ids == p[-9:] for o, p in zip(cut, prompts))
    spec = LLM("preset:qwen3-0.6b", speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **kw)
    for p, want in zip(cases, plain):
        assert [o.token_ids for o in spec.generate(prompts, p)] == want, p
    assert spec.stats()["spec_accepted_tokens"] > 0
    assert spec.engine.kv.num_free_blocks == spec.engine.kv.num_blocks


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_embed_on_cuda_matches_transformers(tmp_path, kind):
    """LLM.embed on CUDA (Triton kernels, decode CUDA graphs captured): a step holding an
    embedding takes the eager forward, also while a generation decodes beside it in chunked steps;
    the vectors are transformers' pooled last_hidden_state (fp32; 1e-3 as the logprobs above), the
    generation's tokens those it makes alone, and every block comes back."""
    from blitzllm import PoolingParams
    from tests.conftest import TINY, make_tiny_checkpoint
    hf = make_tiny_checkpoint("qwen3", tmp_path, seed=3).to("cuda")
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_blocks=128, max_num_seqs=4,
              max_num_batched_tokens=32, pooler_config={"pooling_type": kind})
    assert llm.engine.runner.graphs is not None
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist() for n in (1, 9, 100)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = llm.generate([prompts[1]], params)[0].token_ids
    e = llm.engine
    e.add_request("g", prompts[1], params)
    got = [t for ev in e.step() for t in ev.new_token_ids]
    for i, p in enumerate(prompts):
        e.add_request(f"e{i}", p, PoolingParams())
    vectors = {}
    while e.has_unfinished():
        for ev in e.step():
            got += ev.new_token_ids
            if ev.embedding is not None:
                vectors[ev.request_id] = ev.embedding
    assert got == alone
    for i, p in enumerate(prompts):
        with torch.no_grad():
            h = hf.model(torch.tensor([p], device="cuda")).last_hidden_state[0].float()
        want = torch.nn.functional.normalize({"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind], dim=-1)
        assert (torch.tensor(vectors[f"e{i}"], device="cuda") - want).abs().max().item() < 1e-3, (kind, i)
    raw = llm.embed([prompts[2]], PoolingParams(normalize=False))[0].outputs.embedding
    assert len(raw) == TINY["hidden_size"]
    assert e.kv.num_free_blocks == e.kv.num_blocks
