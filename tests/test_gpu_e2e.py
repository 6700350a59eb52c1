"""GPU end to end: the Triton kernels + CUDA graphs path gives the same greedy tokens as the
torch reference path on the same dummy weights (skipped without CUDA)."""
import pytest
import torch

from blitzllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (int(L),), generator=g).tolist()
            for L in torch.randint(1, 300, (n,), generator=g)]


@pytest.mark.parametrize("preset,layers", [("qwen3-0.6b", 4), ("llama-3.1-8b", 2)])
def test_triton_graphs_match_torch_path_fp32(preset, layers):
    kw = dict(num_layers=layers, device="cuda", dtype="float32", kv_cache_blocks=1024, max_num_seqs=16,
              max_model_len=4096)
    fast = LLM(f"preset:{preset}", **kw)
    assert fast.engine.runner.graphs is not None and fast.engine.runner.backend.name == "triton"
    prompts = _prompts(12, fast.engine.model_config.vocab_size)
    prompts.append(_prompts(1, fast.engine.model_config.vocab_size, seed=5)[0] * 40)  # > 2048: the SDPA prefill
    prompts[-1] = prompts[-1][:2500]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [o.token_ids for o in fast.generate(prompts, params)]
    # chunked prefill mixed with decode on the fast path too
    fast_chunked = LLM(f"preset:{preset}", max_num_batched_tokens=64, **kw)
    got_chunked = [o.token_ids for o in fast_chunked.generate(prompts, params)]
    del fast, fast_chunked
    ref = LLM(f"preset:{preset}", enforce_eager=True, attention_backend="torch", **kw)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    assert got == want
    assert got_chunked == want


def test_bf16_graph_logprobs_close_to_torch_path():
    kw = dict(num_layers=4, device="cuda", dtype="bfloat16", kv_cache_blocks=256, max_num_seqs=8, max_model_len=512)
    prompts = _prompts(4, 151936, seed=1)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    fast = LLM("preset:qwen3-0.6b", **kw).generate(prompts, params)
    ref = LLM("preset:qwen3-0.6b", enforce_eager=True, attention_backend="torch", **kw).generate(prompts, params)
    for a, b in zip(fast, ref):
        ta, tb = a.logprobs[0], b.logprobs[0]
        common = set(ta) & set(tb)
        assert len(common) >= 4
        for t in common:
            assert abs(ta[t] - tb[t]) < 0.1


@pytest.mark.parametrize("chain", [False, True])
@pytest.mark.parametrize("preset,layers", [("qwen3-0.6b", 4), ("llama-3.1-8b", 2)])
def test_glu_gemv_decode_matches_default(monkeypatch, preset, layers, chain):
    """Decode with gate_up as the GLU GEMV (SiLU-and-mul in its epilogue, the default),
    alone or in the norm chain (BLITZ_NORM_CHAIN=1: no RMSNorm launch), gives the default
    unfused bf16 path's greedy tokens, and log-probabilities within bf16 noise (the paths differ in
    the summation order of gate_up (llama: cuBLAS), down_proj and the norms' sums)."""
    import blitzllm.kernels.gemv as gemv
    import blitzllm.models.llama as llama
    kw = dict(num_layers=layers, device="cuda", dtype="bfloat16", kv_cache_blocks=256, max_num_seqs=8,
              max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)
    monkeypatch.setattr(gemv, "GLU_ENABLED", False)  # the baseline: gate_up, then the SiLU-and-mul
    base = LLM(f"preset:{preset}", **kw)
    prompts = _prompts(4, base.engine.model_config.vocab_size, seed=4)
    want = base.generate(prompts, params) + base.generate(prompts[:1], params)  # 4 rows, then 1 (GLU)
    del base
    calls = []
    orig = gemv.gemv_glu_triton
    monkeypatch.setattr(gemv, "GLU_ENABLED", True)
    monkeypatch.setattr(gemv, "gemv_glu_triton", lambda *a, **k: calls.append(1) or orig(*a, **k))
    chained = []
    if chain:
        monkeypatch.setattr(llama.DecoderModel, "norm_chain", True)
        orig_chain = llama.DecoderLayer.forward_chain
        monkeypatch.setattr(llama.DecoderLayer, "forward_chain",
                            lambda self, *a: chained.append(1) or orig_chain(self, *a))
    llm = LLM(f"preset:{preset}", **kw)
    got = llm.generate(prompts, params) + llm.generate(prompts[:1], params)
    assert calls  # the single-prompt decode steps took the GLU GEMV
    assert bool(chained) == chain
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            for t in set(la) & set(lb):
                assert abs(la[t] - lb[t]) < 0.1


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


def test_opt_in_decode_paths_match_default(monkeypatch):
    """The opt-in decode paths (L2 prefetch from the attention kernel, the one-launch MLP, the GEMV two tiles ahead) give the default fast path's greedy tokens (fp32, dummy weights)."""
    import blitzllm.kernels.gemv as gemv
    import blitzllm.models.llama as llama
    kw = dict(num_layers=4, device="cuda", dtype="float32", kv_cache_blocks=512, max_num_seqs=8, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = _prompts(2, 151936, seed=2)  # decode rows of 2 and (the single prompt) 1: the fused MLP's sizes
    base = LLM("preset:qwen3-0.6b", **kw)
    want = [[o.token_ids for o in base.generate(p, params)] for p in (prompts, prompts[:1])]
    del base
    monkeypatch.setenv("BLITZ_L2_PREFETCH", "1")
    monkeypatch.setattr(llama, "FUSED_MLP", True)
    monkeypatch.setattr(gemv, "_FMA_DEPTH", 2)
    llm = LLM("preset:qwen3-0.6b", **kw)
    assert llm.engine.runner.backend.l2_prefetch_bytes > 0
    got = [[o.token_ids for o in llm.generate(p, params)] for p in (prompts, prompts[:1])]
    assert got == want


@pytest.mark.parametrize("preset,layers,select", [("qwen3-30b-a3b", 2, True), ("minimax-m2", 2, True),
                                                   ("deepseek-v3", 4, True), ("qwen3-30b-a3b", 2, False)])
def test_norm_route_decode_matches_default(monkeypatch, preset, layers, select):
    """MoE decode with the post-attention residual add + RMSNorm + router GEMM + selection in
    one launch (BLITZ_MOE_NORM_ROUTE=1; ``select`` off: =2, the selection its own launch) gives
    the default path's greedy tokens (bf16; the router's fp32 sums differ only in order), and
    the launch ran."""
    import blitzllm.kernels.moe as moe
    kw = dict(num_layers=layers, device="cuda", dtype="bfloat16", kv_cache_blocks=256, max_num_seqs=8,
              max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    monkeypatch.setattr(moe, "MOE_NORM_ROUTE", False)
    base = LLM(f"preset:{preset}", **kw)
    prompts = _prompts(3, base.engine.model_config.vocab_size, seed=6)
    want = [o.token_ids for o in base.generate(prompts, params) + base.generate(prompts[:1], params)]
    del base
    calls = []
    orig = moe.norm_route_experts_triton
    monkeypatch.setattr(moe, "MOE_NORM_ROUTE", True)
    monkeypatch.setattr(moe, "_NORM_ROUTE_SELECT", select)
    monkeypatch.setattr(moe, "norm_route_experts_triton", lambda *a, **k: calls.append(a[0].shape[0]) or orig(*a, **k))
    llm = LLM(f"preset:{preset}", **kw)
    got = [o.token_ids for o in llm.generate(prompts, params) + llm.generate(prompts[:1], params)]
    assert calls and max(calls) <= moe.NORM_ROUTE_MAX_T
    assert got == want


def _switch_runs(monkeypatch, module, switch, off, on, launcher, preset, layers, params, seed):
    """Decode outputs (batches of 2 and 1, bf16, CUDA graphs) with ``module.switch`` = off, then
    = on with ``module.launcher`` counted: (outputs off, outputs on, the rows of each counted
    call, the second LLM)."""
    kw = dict(num_layers=layers, device="cuda", dtype="bfloat16", kv_cache_blocks=256, max_num_seqs=8,
              max_model_len=1024)
    monkeypatch.setattr(module, switch, off)
    base = LLM(f"preset:{preset}", **kw)
    prompts = _prompts(2, base.engine.model_config.vocab_size, seed=seed)
    want = [o for p in (prompts, prompts[:1]) for o in base.generate(p, params)]
    del base
    monkeypatch.setattr(module, switch, on)
    calls = []
    orig = getattr(module, launcher)
    monkeypatch.setattr(module, launcher, lambda *a, **k: calls.append(a[0].shape[0]) or orig(*a, **k))
    llm = LLM(f"preset:{preset}", **kw)
    got = [o for p in (prompts, prompts[:1]) for o in llm.generate(p, params)]
    return want, got, calls, llm


@pytest.mark.parametrize("preset,layers", [("qwen3-30b-a3b", 2), ("qwen3-0.6b", 4), ("llama-3.1-8b", 2)])
def test_tma_gemv_decode_matches_fma_gemv(monkeypatch, preset, layers):
    """Decode with o_proj and qkv as the TMA GEMV (the default on Hopper; the attention and the
    input RMSNorm let it launch as they start) gives the FMA GEMV's greedy tokens (bf16, batches of 2
    and 1), and the TMA GEMV ran, in the CUDA graphs too."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Hopper only")
    import blitzllm.kernels.gemv_tma as gemv_tma
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want, got, calls, llm = _switch_runs(monkeypatch, gemv_tma, "TMA_MODE", "0", "1", "gemv_tma_triton", preset,
                                         layers, params, seed=8)
    layer = llm.engine.runner.model.model.layers[0]
    assert layer.self_attn.o_proj.tma_preload and layer.self_attn.qkv_proj.tma_preload
    assert calls and set(calls) <= {1, 2}
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.parametrize("preset,layers", [("qwen3-30b-a3b", 2), ("qwen3-0.6b", 4), ("llama-3.1-8b", 2)])
def test_oproj_merging_attention_partials_matches_default(monkeypatch, preset, layers):
    """Decode with o_proj merging the decode attention's split partials itself (BLITZ_ATTN_OPROJ=1,
    kernels/oproj_partials.py: the attention leaves them unmerged, o_proj adds its heads' products
    into an fp32 sum) against the default (the attention merges, then the TMA GEMV): bf16,
    batches of 2 and 1, CUDA graphs; the path ran at every layer; every step's chosen-token
    logprob agrees within 0.05 and greedy tokens are equal until a step whose two top tokens are
    a near tie in both runs (the sum over heads is taken in another order), none before a
    sequence's fourth token."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Hopper only")
    import blitzllm.kernels.oproj_partials as op
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    calls = []
    orig = op.oproj_partials_triton
    monkeypatch.setattr(op, "oproj_partials_triton", lambda p, *a, **k: calls.append(p.m.shape[0]) or orig(p, *a, **k))
    want, got, asked, llm = _switch_runs(monkeypatch, op, "OPROJ_PARTIALS", False, True, "oproj_partials_ok", preset,
                                         layers, params, seed=8)
    assert all(layer.self_attn.oproj_partials for layer in llm.engine.runner.model.model.layers)
    assert calls and set(calls) <= {1, 2} and len(calls) == len(asked)  # (every decode layer it was asked for)
    _assert_same_until_near_tie(got, want)


@pytest.mark.parametrize("mode", ["1", "qkvo"])
@pytest.mark.parametrize("preset,layers", [("qwen3-30b-a3b", 3), ("minimax-m2", 2)])
def test_moe_pf_qkv_keeps_greedy_tokens(monkeypatch, preset, layers, mode):
    """BLITZ_MOE_PF_QKV=1 (the norm + router launch asks the L2 for the next layer's qkv weights,
    marked evict-last; =qkvo its o_proj weights too) computes the same values: outputs as
    the default's (bf16, batches of 2 and 1, CUDA graphs) up to the run-to-run order of the
    atomic MoE sums (``_assert_same_until_near_tie``), and the prefetch reached the launches of
    every layer but the last."""
    import blitzllm.kernels.moe as moe_ops
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    seen = []
    orig = moe_ops.norm_route_experts_triton
    monkeypatch.setattr(moe_ops, "norm_route_experts_triton",
                        lambda *a, prefetch=(), **k: seen.append(len(prefetch)) or orig(*a, prefetch=prefetch, **k))
    monkeypatch.setattr(moe_ops, "_MOE_PF_QKV", mode)
    want, got, _, llm = _switch_runs(monkeypatch, moe_ops, "MOE_PF_QKV", False, True, "norm_route_ok", preset, layers,
                                     params, seed=16)
    assert seen and max(seen) == (2 if mode == "qkvo" else 1) and min(seen) == 0  # (the last layer: nothing)
    _assert_same_until_near_tie(got, want)


@pytest.mark.parametrize("preset,layers", [("qwen3-30b-a3b", 2), ("qwen3-0.6b", 4), ("llama-3.1-8b", 2)])
def test_tma_gemv_with_the_norm_inside_matches_default(monkeypatch, preset, layers):
    """Decode with the input residual add + RMSNorm inside the qkv TMA GEMV (BLITZ_GEMV_TMA_NORM=1: no
    RMSNorm launch) against the default (bf16, batches of 2 and 1, CUDA graphs): it ran, and the
    outputs agree as in ``_assert_same_until_near_tie`` (the sums of squares in another order)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Hopper only")
    import blitzllm.kernels.gemv_tma as gemv_tma
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    want, got, calls, _ = _switch_runs(monkeypatch, gemv_tma, "TMA_NORM", False, True, "gemv_tma_norm_triton",
                                       preset, layers, params, seed=18)
    assert calls and set(calls) <= {1, 2}
    _assert_same_until_near_tie(got, want)


@pytest.mark.parametrize("preset,layers", [("qwen3-30b-a3b", 2), ("minimax-m2", 2)])
def test_balanced_moe_rows_match_default(monkeypatch, preset, layers):
    """MoE decode with the gate/up programs on balanced rows (BLITZ_MOE_BALANCE=1) against the default
    tiles (bf16, batches of 2 and 1, CUDA graphs): the balanced launch ran, and the outputs agree as
    in ``_assert_same_until_near_tie`` (the atomic expert sums come in a run-dependent order)."""
    import blitzllm.kernels.fused_moe as fm
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    rows = []
    orig = fm._grouped_gemm
    monkeypatch.setattr(fm, "_grouped_gemm", lambda *a, **k: rows.append(k.get("rows")) or orig(*a, **k))
    want, got, calls, _ = _switch_runs(monkeypatch, fm, "MOE_BALANCE", False, True, "_direct", preset, layers,
                                       params, seed=20)
    assert calls and any(r is not None for r in rows)
    _assert_same_until_near_tie(got, want)


# Known failure (stop 29, H200, the first form of the kernel): qwen3-30b-a3b and qwen3-0.6b gave other
# greedy tokens than the FMA form, llama-3.1-8b the same ones, while the kernel matched the torch
# reference within rtol 1e-2 at every shape tested; whether the tensor cores' fp32 accumulation or a
# bug is the cause is open (scripts/mma_precision.py compares both forms with an fp64 product). The
# tensor-core form stays opt-in until this passes; strict=False so a pass shows as XPASS.
@pytest.mark.xfail(strict=False, reason="stop 29: other greedy tokens than the FMA form on 2 of 3 presets, cause open")
@pytest.mark.parametrize("preset,layers", [("qwen3-30b-a3b", 2), ("qwen3-0.6b", 4), ("llama-3.1-8b", 2)])
def test_tma_gemv_tensor_cores_match_fma_form(monkeypatch, preset, layers):
    """Decode with the TMA GEMV's products on the tensor cores (BLITZ_GEMV_TMA_MMA=1) gives the
    FMA form's greedy tokens (bf16, batches of 2 and 1; fp32 sums in another order), and the
    tensor-core launch ran, in the CUDA graphs too."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Hopper only")
    import blitzllm.kernels.gemv_tma as gemv_tma
    monkeypatch.setattr(gemv_tma, "TMA_MODE", "1")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want, got, calls, llm = _switch_runs(monkeypatch, gemv_tma, "TMA_MMA", False, True, "_launch_mma", preset,
                                         layers, params, seed=8)
    assert calls and set(calls) <= {1, 2}
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.parametrize("preset,layers", [("qwen3-30b-a3b", 2), ("minimax-m2", 2), ("deepseek-v3", 4)])
@pytest.mark.parametrize("switch,off,on,launcher", [("MOE_TMA", "0", "1", "moe_tma_triton"),
                                                    ("MOE_TMA_DOWN", False, True, "moe_tma_down_triton")])
def test_tma_moe_decode_matches_direct_moe(monkeypatch, preset, layers, switch, off, on, launcher):
    """MoE decode with the experts as the one-launch TMA MoE (BLITZ_MOE_TMA=1, Hopper, 1-2
    tokens), or the direct path with its down GEMM as the TMA down launch (BLITZ_MOE_TMA_DOWN=1),
    against the direct path's two grouped GEMMs (bf16, batches of 2 and 1, CUDA graphs):
    the launch ran; every step's chosen-token logprob agrees within 0.05; greedy tokens are equal
    until a step where the two paths' top tokens are a near tie (logprobs within 0.05 of each other
    in both runs: the expert sums are taken in another order, FMAs against tensor-core MMAs, so a
    last-bit difference may pick the other of two equal tokens), and no sequence diverges before
    its fourth token."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Hopper only")
    import blitzllm.kernels.moe_tma as moe_tma
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    want, got, calls, llm = _switch_runs(monkeypatch, moe_tma, switch, off, on, launcher, preset, layers, params,
                                         seed=12)
    # rows of the counted calls' first argument: tokens (x), or (token, k) entries (act)
    per = llm.engine.model_config.hf_config["num_experts_per_tok"] if switch == "MOE_TMA_DOWN" else 1
    assert calls and set(calls) <= {per, 2 * per}
    _assert_same_until_near_tie(got, want)


def _assert_same_until_near_tie(got, want):
    """Every step's chosen-token logprob agrees within 0.05; greedy tokens are equal until a
    step where the two runs' top tokens are a near tie (logprobs within 0.05 of each other in
    both), and no sequence diverges before its fourth token."""
    for g, w in zip(got, want):
        d = next((i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b), None)
        for i in range(len(g.token_ids) if d is None else d):
            t = w.token_ids[i]
            assert abs(g.logprobs[i][t] - w.logprobs[i][t]) < 0.05, (i, g.logprobs[i][t], w.logprobs[i][t])
        if d is not None:
            a, b = g.token_ids[d], w.token_ids[d]
            assert d >= 3, f"diverged at token {d}"
            for lp in (g.logprobs[d], w.logprobs[d]):
                assert a in lp and b in lp and abs(lp[a] - lp[b]) < 0.05, (d, a, b, lp)


@pytest.mark.parametrize("preset,layers", [("qwen3-30b-a3b", 2), ("minimax-m2", 2)])
def test_atomic_moe_combine_matches_counted_combine(monkeypatch, preset, layers):
    """MoE decode whose down programs add the weighted expert outputs into an fp32 sum with
    atomics (the default: the next residual add + RMSNorm rounds it) against the direct path's
    counted combine (BLITZ_MOE_ATOMIC_COMBINE=0), bf16, batches of 2 and 1, CUDA graphs: the
    fp32 sums ran, and the outputs agree as in ``_assert_same_until_near_tie`` (the fp32
    additions come in another order)."""
    import blitzllm.kernels.fused_moe as fm
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    atomic = []
    orig = fm._grouped_gemm
    monkeypatch.setattr(fm, "_grouped_gemm", lambda *a, **k: atomic.append(k.get("atomic", False)) or orig(*a, **k))
    want, got, calls, llm = _switch_runs(monkeypatch, fm, "MOE_ATOMIC_COMBINE", False, True, "_direct", preset,
                                         layers, params, seed=14)
    assert calls and any(atomic)
    assert all(m.fp32_sum for m in llm.engine.runner.model.modules() if hasattr(m, "fp32_sum"))
    _assert_same_until_near_tie(got, want)



@pytest.mark.parametrize("preset,layers", [("qwen3-30b-a3b", 2), ("minimax-m2", 2), ("deepseek-v3", 4),
                                           ("qwen3-0.6b", 4)])
def test_fp8_weights_match_their_dequantized_bf16_values(monkeypatch, preset, layers):
    """weight_dtype='fp8' on CUDA (the FP8 linear kernel, the MoE GEMMs with float8 experts, CUDA
    graphs; bf16 activations) against the default bf16 path on the same weights dequantized (each
    quantized and widened back in place, graphs kept): the FP8 kernels ran, and the outputs agree
    as in ``_assert_same_until_near_tie``."""
    import copy

    import blitzllm.kernels.fp8_weights as fw
    import blitzllm.kernels.fused_moe as fm
    from blitzllm.layers.linear import Linear, quantize_fp8_weights
    from blitzllm.layers.moe import FusedMoE
    kw = dict(num_layers=layers, device="cuda", dtype="bfloat16", kv_cache_blocks=256, max_num_seqs=8,
              max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    ref = LLM(f"preset:{preset}", **kw)
    model = ref.engine.runner.model
    twin = copy.deepcopy(model)
    quantize_fp8_weights(twin)
    live = dict(model.named_modules())
    with torch.no_grad():
        for name, mod in twin.named_modules():
            if isinstance(mod, Linear) and mod.fp8_block is not None:
                live[name].weight.copy_(fw.dequantize(mod.weight, mod.weight_scale_inv, mod.fp8_block, torch.bfloat16))
            elif isinstance(mod, FusedMoE) and mod.fp8_block is not None:
                live[name].w13.copy_(fw.dequantize(mod.w13, mod.w13_scale_inv, mod.fp8_block, torch.bfloat16))
                live[name].w2.copy_(fw.dequantize(mod.w2, mod.w2_scale_inv, mod.fp8_block, torch.bfloat16))
    del twin
    prompts = _prompts(2, ref.engine.model_config.vocab_size, seed=21)
    want = [o for p in (prompts, prompts[:1]) for o in ref.generate(p, params)]
    del ref, model, live
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
    _assert_same_until_near_tie(got, want)


def test_mtp_speculation_matches_plain_greedy():
    """method 'mtp' on CUDA (preset:deepseek-v3, 2 dense layers, its dummy MTP layer an MoE
    one; bf16): the drafts ran and the outputs agree with the plain engine's as in
    ``_assert_same_until_near_tie`` (verify rows run other shapes than plain decode)."""
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
    _assert_same_until_near_tie(got, want)


def test_structured_output_on_cuda():
    """A json_schema structured output on CUDA (CUDA graphs on; the constrained row skips the
    decode look-ahead) beside an unconstrained request, which keeps its tokens."""
    import json
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    llm = LLM("smollm2", device="cuda", dtype="bfloat16", kv_cache_blocks=256, max_num_seqs=8)
    prompt = llm.apply_chat_template([{"role": "user", "content": "Describe a person as JSON with name and age."}])
    plain = SamplingParams(temperature=0, max_tokens=40)
    alone = llm.generate([prompt], plain)[0]
    outs = llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=60, structured_output={
        "type": "json_schema", "schema": schema}), plain])
    obj = json.loads(outs[0].text)
    assert list(obj) == ["name", "age"] and isinstance(obj["age"], int)
    assert outs[1].token_ids == alone.token_ids
