"""runner/cpu_graph.py: the CPU decode step, compiled (torch.compile, inductor) and eager, gives
the model's own eager forward's greedy tokens at batch 1, 3 and 8, with chunked prefill and
prefix caching on (prompts sharing a prefix longer than a block, a token budget smaller than
the prompts). One compile per batch class (1; 2 and more), context length symbolic."""
import pytest
import torch

from blitzllm import LLM, SamplingParams

KW = dict(device="cpu", dtype="float32", kv_cache_blocks=64, block_size=16, max_num_batched_tokens=24,
          enable_prefix_caching=True, max_num_seqs=8)


def _prompts():
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(1, 300, (21,), generator=g).tolist()
    return [shared + torch.randint(1, 300, (5 + 7 * i,), generator=g).tolist() for i in range(8)]


def _run(llm, prompts):
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, p)]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(str(tiny_llama[0]), **KW)
    llm.engine.runner.cpu_decode = None  # every step through the model's forward
    prompts = _prompts()
    return {b: _run(llm, prompts[:b]) for b in (1, 3, 8)}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cpu_decode_greedy_equals_model_forward(tiny_llama, reference, compiled, monkeypatch):
    monkeypatch.setenv("BLITZ_CPU_COMPILE", "1" if compiled else "0")
    llm = LLM(str(tiny_llama[0]), **KW)
    dec = llm.engine.runner.cpu_decode
    assert dec is not None and dec.compiled == compiled
    assert (dec.compile_s > 0) == compiled  # (compiled at start-up, not in the first request)
    prompts = _prompts()
    for b in (1, 3, 8):
        assert _run(llm, prompts[:b]) == reference[b], b
        assert _run(llm, prompts[:b]) == reference[b], b  # again: the shared prefix now cached
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_gguf_blocks_decode_compiled_and_eager_equal_model_forward(monkeypatch):
    """The default model's GGUF blocks (our AVX-512 kernel; through a custom op when compiled),
    4 layers: the decode step compiled and eager gives the model forward's greedy tokens."""
    kw = dict(device="cpu", num_layers=4, max_num_batched_tokens=24, enable_prefix_caching=True, kv_cache_blocks=64)
    ref = LLM("smollm2", **kw)
    assert ref.engine.runner.model.lm_head.quant.parts is None
    ref.engine.runner.cpu_decode = None
    prompts = _prompts()
    want = {b: _run(ref, prompts[:b]) for b in (1, 3)}
    for compiled in (False, True):
        monkeypatch.setenv("BLITZ_CPU_COMPILE", "1" if compiled else "0")
        llm = LLM("smollm2", **kw)
        assert llm.engine.runner.cpu_decode.compiled == compiled
        for b in (1, 3):
            assert _run(llm, prompts[:b]) == want[b], (compiled, b)


def test_one_call_step_equals_layer_by_layer():
    """kernels/cpu_decode's DecodeLayers (every layer in one C call) against the same step layer
    by layer in torch ops (layer_step, the GGUF kernel through Python), logits of a batch of 3
    rows at different lengths on the same caches."""
    llm = LLM("smollm2", device="cpu", num_layers=6, kv_cache_blocks=8)  # (the blocks below)
    dec = llm.engine.runner.cpu_decode
    assert dec.step_layers is not None
    bs = dec.block_size
    lens = [5, 2 * bs + 3, 3 * bs]
    tables = [[0], [1, 2, 3], [4, 5, 6]]
    slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens)]
    g = torch.Generator().manual_seed(0)
    for kc, vc in dec.kv_caches:
        kc.copy_(torch.randn(kc.shape, generator=g))
        vc.copy_(torch.randn(vc.shape, generator=g))
    saved = [(kc.clone(), vc.clone()) for kc, vc in dec.kv_caches]
    args = ([11, 2000, 30000], [n - 1 for n in lens], slots, lens, tables)
    one = dec.run(*args)
    caches_one = [(kc.clone(), vc.clone()) for kc, vc in dec.kv_caches]
    for (kc, vc), (k0, v0) in zip(dec.kv_caches, saved):
        kc.copy_(k0)
        vc.copy_(v0)
    dec.step_layers = None
    layered = dec.run(*args)
    # fp32 noise: C and torch sum the norms, attention and matmuls in other orders, six layers deep
    assert (one - layered).abs().max() <= 2e-5 * one.abs().max(), (one - layered).abs().max()
    assert torch.equal(one.argmax(-1), layered.argmax(-1))
    for (a, b), (c, d) in zip(caches_one, dec.kv_caches):
        # (fp32: silu and sums in another order, six layers deep)
        assert torch.allclose(a, c, rtol=1e-5, atol=1e-4) and torch.allclose(b, d, rtol=1e-5, atol=1e-4), \
            ((a - c).abs().max(), (b - d).abs().max())


def test_one_call_step_without_its_head_and_out_of_range_rows():
    """The one-call step without an lm_head returns the final norm's output, which the model's
    compute_logits (the same GGUF kernel through Python) turns into the one-call step's logits;
    a token id, position or length out of range is a ValueError, not a read past a table."""
    from blitzllm.kernels import cpu_decode
    from blitzllm.kernels.cpu_quant import native
    llm = LLM("smollm2", device="cpu", num_layers=2)
    dec = llm.engine.runner.cpu_decode
    assert dec.head_in_step
    layers, ends = dec.step_layers.tensors
    hq, hkv, d, inter, eps, scale, qk_eps = dec.layers[0][9]
    bare = cpu_decode.DecodeLayers(layers, hq, hkv, d, inter, eps, qk_eps, scale, ends[:4] + (None,) + ends[5:],
                                   native.gemm_addresses())
    saved = [(kc.clone(), vc.clone()) for kc, vc in dec.kv_caches]
    args = ([11, 2000], [4, 20], [5, 21], [[0], [1, 2]])
    logits = dec.step_layers.step(*args).clone()
    for (kc, vc), (k0, v0) in zip(dec.kv_caches, saved):
        kc.copy_(k0)
        vc.copy_(v0)
    hidden = bare.step(*args)
    assert hidden.shape == (2, ends[0].shape[1]) and logits.shape == (2, ends[0].shape[0])
    assert torch.equal(dec.model.compute_logits(hidden), logits)
    V, P, bs, nblocks = ends[0].shape[0], ends[1].shape[0], dec.block_size, dec.kv_caches[0][0].shape[0]
    for bad in (([V], [4], [5], [[0]]), ([-1], [4], [5], [[0]]), ([1], [P], [P + 1], [list(range(P // bs + 1))]),
                ([1], [5], [5], [[0]]), ([1], [4], [bs + 1], [[0]]), ([1], [4], [5], [[nblocks]]),
                ([1, 1], [4, 4], [5, 5], [[0], [-1]])):
        with pytest.raises(ValueError, match="out of range"):
            dec.step_layers.step(*bad)


def test_bf16_weights_fp32_activations_one_call(tiny_llama, reference):
    """``weight_dtype="bfloat16"`` under fp32 activations: the one-call step with our bf16
    kernel gives the model forward's greedy tokens (the same engine, steps through the modules)."""
    llm = LLM(str(tiny_llama[0]), weight_dtype="bfloat16", **KW)
    dec = llm.engine.runner.cpu_decode
    assert dec.step_layers is not None
    prompts = _prompts()
    got = {b: _run(llm, prompts[:b]) for b in (1, 3, 8)}
    llm.engine.runner.cpu_decode = None
    assert got == {b: _run(llm, prompts[:b]) for b in (1, 3, 8)}


def test_bf16_decode_equals_model_forward(tiny_llama):
    """``dtype="bfloat16"``: the decode step computes as the model's own forward does in bf16
    (torch's bf16 GEMMs, not our fp32 kernel, on oneDNN-packed copies of the weights; our C glue
    rounding where the model's ops round), so their greedy tokens agree at batch 1, 3 and 8."""
    kw = {**KW, "dtype": "bfloat16"}
    ref = LLM(str(tiny_llama[0]), **kw)
    ref.engine.runner.cpu_decode = None
    llm = LLM(str(tiny_llama[0]), **kw)
    dec = llm.engine.runner.cpu_decode
    assert dec is not None and dec.step_layers is None and dec.bf16_glue and dec.packed is not None
    assert all(len(w) == 1 for layer in dec.layers for w in (layer[2], layer[6], layer[7], layer[8]))
    from blitzllm.kernels import cpu_gemm
    assert (dec.step_bf16 is not None) == (cpu_gemm.gemv_lib() is not None)  # batch 1: the one-call step
    prompts = _prompts()
    for b in (1, 3, 8):
        assert _run(llm, prompts[:b]) == _run(ref, prompts[:b]), b


def test_bf16_one_call_step_equals_the_layer_by_layer_form(tiny_llama):
    """The one-row bf16 step in one C call (``DecodeLayersBf16``) gives the layer-by-layer bf16
    form's logits (the same C glue and one-row GEMV, Python between them): equal but where our
    expf and torch's silu round a bf16 value differently, a few bf16 steps of one logit at most."""
    from blitzllm.kernels import cpu_gemm
    if cpu_gemm.gemv_lib() is None:
        pytest.skip("no AVX512-BF16 here")
    llm = LLM(str(tiny_llama[0]), **{**KW, "dtype": "bfloat16"})
    dec = llm.engine.runner.cpu_decode
    _run(llm, _prompts()[:1])   # (a cache with rows in it: block 0 holds the prompt)
    one_call = dec.step_bf16
    for n in (1, 9, 17):   # context lengths, past one block
        args = ([5 + n], [n - 1], [n - 1], [n], [[0, 1]])
        got = dec.run(*args)
        dec.step_bf16 = None
        want = dec.run(*args)
        dec.step_bf16 = one_call
        assert got.shape == want.shape == (1, 320)
        assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item(), n
        assert (got == want).float().mean().item() > 0.9, n


def test_fp8_cache_decode_equals_model_forward(tiny_llama):
    """kv_cache_dtype="fp8" in fp32: the C one-call step writes and reads the fp8 cache as the model's
    own layers do, so their greedy tokens agree at batch 1, 3 and 8, and the caches they leave hold
    the same bytes."""
    kw = {**KW, "kv_cache_dtype": "fp8"}
    ref = LLM(str(tiny_llama[0]), **kw)
    ref.engine.runner.cpu_decode = None
    llm = LLM(str(tiny_llama[0]), **kw)
    assert llm.engine.runner.cpu_decode.step_layers is not None
    prompts = _prompts()
    for b in (1, 3, 8):
        assert _run(llm, prompts[:b]) == _run(ref, prompts[:b]), b
    for (k1, v1), (k2, v2) in zip(llm.engine.runner.kv_caches, ref.engine.runner.kv_caches):
        assert k1.dtype == torch.float8_e4m3fn
        assert torch.equal(k1.view(torch.uint8), k2.view(torch.uint8)) and torch.equal(v1.view(torch.uint8), v2.view(torch.uint8))


def test_bf16_fp8_cache_decode_follows_model_forward(tiny_llama):
    """kv_cache_dtype="fp8" under bf16 (the C glue, and the one-row step): its k can sit one bf16
    step from the model's (the bf16 form's own bound), which an fp8 rounding boundary between them
    turns into one e4m3 step, so the runs may part; where they do, the model ranks the C path's
    token within 0.2 of its own (a near tie), and before that their logprobs agree within 0.1: about
    half the bf16 model's own distance from the fp32 one on this peaky model (0.1-0.2 a token; the C
    path's was 0.05 at most here)."""
    kw = {**KW, "dtype": "bfloat16", "kv_cache_dtype": "fp8"}
    ref = LLM(str(tiny_llama[0]), **kw)
    ref.engine.runner.cpu_decode = None
    llm = LLM(str(tiny_llama[0]), **kw)
    assert llm.engine.runner.cpu_decode.bf16_glue
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    prompts = _prompts()
    for b in (1, 3, 8):
        for a, o in zip(ref.generate(prompts[:b], p), llm.generate(prompts[:b], p)):
            j = next((i for i, (x, y) in enumerate(zip(a.token_ids, o.token_ids)) if x != y), len(a.token_ids))
            for i in range(j):
                assert abs(a.logprobs[i][a.token_ids[i]] - o.logprobs[i][o.token_ids[i]]) <= 0.1, (b, i)
            if j < len(a.token_ids):
                lp = a.logprobs[j]
                assert o.token_ids[j] in lp and lp[a.token_ids[j]] - lp[o.token_ids[j]] <= 0.2, (b, j, lp)
