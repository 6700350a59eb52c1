"""kv_cache_dtype="fp8": keys and values stored as float8 e4m3 (kernels/attention/kv_store.py).

The oracle is transformers with an attention function that rounds its keys (after rotary) and
values to e4m3 as the cache does (clamp to +-448, round to nearest even; idempotent, so re-rounding
the past keys of its own cache each step changes nothing): the engine's fp8 cache must follow
that model, not the unrounded one."""
import pytest
import torch

from blitzllm import LLM, SamplingParams
from tests.conftest import hf_greedy, hf_logprobs

F8 = torch.float8_e4m3fn
PROMPTS = ["The capital of France is", "def fib(n):", "List three colors:"]


def _fp8_kv_attention(module, query, key, value, *args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def r(t):
        return t.clamp(-448, 448).to(F8).to(t.dtype)
    return sdpa_attention_forward(module, query, r(key), r(value), *args, **kwargs)


def _chosen_logprobs(out) -> list:
    return [d[t] for d, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]


@pytest.fixture(scope="module")
def fp8_llm():
    return LLM("smollm2", dtype="float32", device="cpu", kv_cache_dtype="fp8", kv_cache_blocks=64)


def test_fp8_cache_follows_the_fp8_rounded_model(fp8_llm, smollm2_hf):
    """SmolLM2 in fp32 over an fp8 cache (prefill through the model's layers, decode steps through the C
    step of kernels/cpu_decode): its greedy tokens are those of transformers over fp8-rounded
    K/V, and its logprobs sit far closer to that model's than to the unrounded one's (the two models
    differ by about 0.05 a token here; the engine follows the rounded one to fp32 noise, which now
    and then moves an element across an fp8 rounding boundary)."""
    from transformers import AttentionInterface
    AttentionInterface.register("blitz_fp8_kv", _fp8_kv_attention)
    assert fp8_llm.engine.runner.kv_caches[0][0].dtype == F8
    assert fp8_llm.engine.runner.cpu_decode.step_layers is not None   # (decode steps: decode.c's fp8 form)
    tok = fp8_llm.get_tokenizer()
    outs = fp8_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0))
    err_fp8 = err_plain = 0.0
    try:
        for prompt, out in zip(PROMPTS, outs):
            ids, gen = tok.encode(prompt), list(out.outputs[0].token_ids)
            ours = torch.tensor(_chosen_logprobs(out))
            smollm2_hf.set_attn_implementation("blitz_fp8_kv")
            assert gen == hf_greedy(smollm2_hf, ids, 16, guess=gen), prompt
            err_fp8 += (ours - hf_logprobs(smollm2_hf, ids, gen)).abs().mean().item()
            smollm2_hf.set_attn_implementation("sdpa")
            err_plain += (ours - hf_logprobs(smollm2_hf, ids, gen)).abs().mean().item()
    finally:
        smollm2_hf.set_attn_implementation("sdpa")
    assert err_fp8 < 0.25 * err_plain, (err_fp8, err_plain)


def test_fp8_cache_prefix_hits_and_block_budget(fp8_llm):
    """A prompt's fp8 blocks serve a second request from the prefix cache with the same greedy
    answer; and in the same byte budget an fp8 cache plans 4x the blocks of an fp32 one, 2x a bf16 one."""
    from blitzllm.engine.args import EngineArgs, plan_kv_blocks
    eng = fp8_llm.engine
    prompt = "Once upon a time, in a land far away, there lived a dragon who loved to read books about"
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = fp8_llm.generate([prompt], p)[0].outputs[0].token_ids
    hits = eng.kv.hit_tokens
    assert fp8_llm.generate([prompt], p)[0].outputs[0].token_ids == first
    assert eng.kv.hit_tokens - hits >= 16
    cfg, cpu = eng.model_config, torch.device("cpu")

    def blocks(kv, dtype):
        return plan_kv_blocks(EngineArgs(kv_cache_dtype=kv, max_num_seqs=64), cfg, dtype, cpu)
    f32, bf16 = blocks("auto", torch.float32), blocks("auto", torch.bfloat16)
    assert 4 * f32 <= blocks("fp8", torch.float32) < 4 * (f32 + 1)   # (whole blocks of the same budget)
    assert 2 * bf16 <= blocks("fp8_e4m3", torch.bfloat16) < 2 * (bf16 + 1)


@pytest.mark.parametrize("bad", ["fp16", "int8", 8, None])
def test_bad_kv_cache_dtype_is_refused(bad):
    from blitzllm.engine.args import EngineArgs, check_engine_args
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        check_engine_args(EngineArgs(kv_cache_dtype=bad))


def test_cli_refuses_a_bad_kv_cache_dtype(capsys):
    from blitzllm.cli import main
    with pytest.raises(SystemExit) as e:
        main(["generate", "--kv-cache-dtype", "int8", "--prompt", "hi"])
    assert e.value.code == 2 and "--kv-cache-dtype" in capsys.readouterr().err


def test_pulled_blocks_land_in_an_fp8_cache():
    """P/D disaggregation lands a producer's fp8 blocks byte for byte (the CPU has no fp8
    index_copy_: kv_store.copy_rows copies them as bytes)."""
    from blitzllm.kv_transfer.base import land_shard
    cache = torch.zeros(6, 4, 2, 8, dtype=F8)
    src = (torch.randn(2, 4, 2, 8) * 100).to(F8)
    land_shard([(cache, cache)], ((0, 0, (4, 2, 8)),), [4, 1], [src], 0, 1)
    assert torch.equal(cache[[4, 1]].view(torch.uint8), src.view(torch.uint8))
    assert not cache[[0, 2, 3, 5]].float().any()


@pytest.mark.parametrize("arch", ["v3", "v32"])
def test_mla_latents_are_the_fp8_rounded_latents(arch, tmp_path):
    """DeepSeek-V3 (MLA) and V3.2 (sparse MLA + indexer) over an fp8 cache: after the same prefill,
    layer 0's latents (which depend on the prompt alone) are those of an fp32 engine over an fp32 cache
    rounded by ``to_cache``, byte for byte; the indexer's keys stay fp32 and equal; the transfer
    layout names both dtypes; and decode steps over the fp8 latents run."""
    from blitzllm.kernels.attention.kv_store import to_cache
    from blitzllm.kv_transfer.base import CacheLayout
    from tests.models.test_deepseek_v3 import make_tiny_deepseek
    from tests.models.test_deepseek_v32 import make_tiny_v32
    (make_tiny_v32 if arch == "v32" else make_tiny_deepseek)(tmp_path, seed=3, num_hidden_layers=2)
    prompt = {"prompt_token_ids": torch.randint(1, 320, (37,), generator=torch.Generator().manual_seed(1)).tolist()}
    caches = {}
    for kv in ("auto", "fp8"):
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_dtype=kv, kv_cache_blocks=8)
        llm.generate([prompt], SamplingParams(max_tokens=1))
        caches[kv] = [t.clone() for t in llm.engine.runner.kv_caches[0] if t is not None]
    (lat, *keys), (lat8, *keys8) = caches["auto"], caches["fp8"]
    assert lat8.dtype == F8 and torch.equal(lat8.view(torch.uint8), to_cache(lat, F8).view(torch.uint8))
    assert lat8.float().abs().amax(dim=(0, 1, 2)).gt(0).all()  # (every latent column written somewhere)
    assert [k.dtype for k in keys8] == [torch.float32] * len(keys) and all(map(torch.equal, keys, keys8))
    layout = CacheLayout.of(llm.engine.runner.kv_caches, 16, 1)
    assert layout.dtype == ("float8_e4m3fn/float32" if arch == "v32" else "float8_e4m3fn")
    assert layout.entry_dtype(0) == F8
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0))[0]
    assert len(out.outputs[0].token_ids) == 6 and all(torch.isfinite(torch.tensor(_chosen_logprobs(out))))


@pytest.mark.gpu
@pytest.mark.parametrize("preset,layers", [("qwen3-0.6b", 4), ("llama-3.1-8b", 2), ("deepseek-v3", 4)])
def test_gpu_fp8_cache_matches_the_reference_ops(monkeypatch, preset, layers):
    """bf16 over an fp8 cache on the GPU (the Triton prefill, the fused q/k norm + rotary + cache
    write, the fused decode kernel, MLA's prep and decode kernels, CUDA graphs) agrees step by step
    with the torch reference ops over an fp8 cache of their own (``tests/gpu_parity.py``)."""
    from tests.gpu_parity import BF16_TOL, assert_runs_agree
    kw = dict(num_layers=layers, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", kv_cache_blocks=256,
              max_num_seqs=8, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    fast = LLM(f"preset:{preset}", **kw)
    assert fast.engine.runner.graphs is not None and fast.engine.runner.kv_caches[0][0].dtype == F8
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(100, 30000, (n,), generator=g).tolist() for n in (37, 210)]
    fast_outs = [o for p in (prompts, prompts[:1]) for o in fast.generate(p, params)]
    del fast
    torch.cuda.empty_cache()
    with monkeypatch.context() as m:
        m.setenv("BLITZ_REFERENCE", "1")
        ref = LLM(f"preset:{preset}", **kw)
    assert ref.engine.runner.backend.name == "torch"
    ref_outs = [o for p in (prompts, prompts[:1]) for o in ref.generate(p, params)]
    assert_runs_agree(ref, prompts + prompts[:1], ref_outs, fast_outs, params, tol=BF16_TOL)
