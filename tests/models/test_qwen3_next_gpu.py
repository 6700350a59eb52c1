"""Qwen3-Next / Qwen3.5 on CUDA (skipped without a GPU): fla-core's prefill conv and chunked
rule, our decode kernels (post-conv, in-place recurrent rule, output norm), and the decode CUDA graphs that
read the state rows from their buffer, against transformers on tiny checkpoints and against
the forced-reference engine (BLITZ_REFERENCE=1: every op on its torch reference, no graphs)
on bf16 presets."""
import pytest
import torch

from blitzllm import LLM, SamplingParams
from tests.models.test_qwen3_next import ARCHS, _prompts, assert_no_leaks, make_hybrid_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_graphs_and_kernels_match_transformers(tmp_path, arch):
    """fp32 tiny checkpoints, every CUDA path (graphs captured, decode steps through them):
    transformers' greedy tokens on the GPU and first-token logprobs within 5e-3, batched, in
    8-token chunks and again from the prefix cache; the post-conv kernel ran; nothing left
    allocated. The bound is TF32's: fla's chunked rule takes its fp32 dots in TF32 (a 10-bit
    mantissa, 2^-11 relative per operand), and so does transformers' own call of it here, on other
    shapes; an H100 put the Qwen3.5 checkpoints 2.2e-3 off. (IEEE dots, TRITON_F32_DEFAULT=ieee,
    made fla's autotuned compiles run past 150 s for one checkpoint.)"""
    from blitzllm.kernels.gdn import post_conv
    calls = []
    orig = post_conv.post_conv_decode_triton
    post_conv.post_conv_decode_triton = lambda *a: calls.append(a[0].shape[0]) or orig(*a)
    try:
        hf = make_hybrid_checkpoint(arch, tmp_path, seed=2).to("cuda")
        prompts = _prompts((1, 5, 17, 40))
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
        for kw in (dict(), dict(max_num_batched_tokens=8)):
            llm = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_blocks=64, max_num_seqs=4, **kw)
            assert llm.engine.runner.graphs is not None and llm.engine.runner.states is not None
            for _ in range(2):
                for prompt, out in zip(prompts, llm.generate(prompts, params)):
                    ids = torch.tensor([prompt], device="cuda")
                    with torch.no_grad():
                        want = hf.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                           eos_token_id=None, pad_token_id=0,
                                           attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
                        first = torch.log_softmax(hf(ids).logits[0, -1].float(), -1)
                    assert out.token_ids == want
                    for tok, lp in out.logprobs[0].items():
                        assert abs(lp - first[tok].item()) < 5e-3
                st = assert_no_leaks(llm)
            assert st["state_snapshot_hit_tokens"] > 0
    finally:
        post_conv.post_conv_decode_triton = orig
    assert calls


@pytest.mark.parametrize("preset,layers", [("qwen3.5-4b", 8), ("qwen3-next-80b-a3b", 4), ("qwen3.5-397b-a17b", 4)])
def test_bf16_presets_match_the_reference_engine(monkeypatch, preset, layers):
    """bf16 presets (dummy weights, a few layers), CUDA graphs at batches 3 and 1: the outputs
    agree with the forced-reference engine's step by step (tests/gpu_parity.py)."""
    from tests.gpu_parity import BF16_TOL, assert_runs_agree
    from tests.test_gpu_e2e import _reference
    kw = dict(num_layers=layers, device="cuda", dtype="bfloat16", kv_cache_blocks=256, max_num_seqs=4,
              max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    fast = LLM(f"preset:{preset}", **kw)
    assert fast.engine.runner.graphs is not None
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(100, 100000, (n,), generator=g).tolist() for n in (3, 70, 200)]
    got = [o for p in (prompts, prompts[:1]) for o in fast.generate(p, params)]
    assert_no_leaks(fast)
    del fast
    torch.cuda.empty_cache()
    ref = _reference(monkeypatch, f"preset:{preset}", **kw)
    want = [o for p in (prompts, prompts[:1]) for o in ref.generate(p, params)]
    # (the reference is the engine alive: at a near-tie fork it restarts on the fast path's tokens)
    assert_runs_agree(ref, prompts + prompts[:1], want, got, params, tol=BF16_TOL)


def test_stacked_shared_expert_on_cuda_matches_transformers(tmp_path):
    """An fp32 tiny Qwen3-Next whose shared expert is as wide as a routed one: the decode plan
    stacks it as expert E on CUDA, and one sequence at a time (one-token steps through the
    graphs, the direct-path routing with the gate's entry) and batched it gives transformers'
    greedy tokens, first-token logprobs within 5e-3 (the TF32 bound above)."""
    from tests.models.test_qwen3_next import MOE
    from blitzllm.models.qwen3_next import SharedExpertMoE
    hf = make_hybrid_checkpoint("qwen3_next", tmp_path, seed=4,
                                shared_expert_intermediate_size=MOE["moe_intermediate_size"]).to("cuda")
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_blocks=64, max_num_seqs=4)
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SharedExpertMoE)]
    assert blocks and all(m.stacks is not None for m in blocks)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    prompts = _prompts((1, 5, 17, 40))
    outs = [o for p in prompts for o in llm.generate([p], params)] + llm.generate(prompts, params)
    for prompt, out in zip(prompts + prompts, outs):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            want = hf.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, eos_token_id=None,
                               pad_token_id=0, attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
            first = torch.log_softmax(hf(ids).logits[0, -1].float(), -1)
        assert out.token_ids == want
        for tok, lp in out.logprobs[0].items():
            assert abs(lp - first[tok].item()) < 5e-3
    assert_no_leaks(llm)
