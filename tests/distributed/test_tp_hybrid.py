"""Hybrid GDN models with tensor parallelism on the CPU (gloo, two processes): the GDN heads
(projection rows, conv channels, A_log / dt_bias, states, out_proj's columns) and the gated
attention split over the ranks give transformers' greedy tokens and logprobs, also through
chunked prefill and prefix caching (the plan's restores and snapshots run on every rank);
nothing stays allocated; heads that do not split are a user error before any process starts."""
import pytest
import torch

from blitzllm import LLM, SamplingParams
from tests.models.test_qwen3_next import _prompts, assert_no_leaks, make_hybrid_checkpoint


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_hybrid_tp2_matches_transformers(tmp_path, arch):
    from tests.conftest import hf_greedy, hf_logprobs
    hf = make_hybrid_checkpoint(arch, tmp_path, seed=5)
    prompts = _prompts((1, 5, 17, 40))
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    with LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=64, tensor_parallel_size=2,
             max_num_batched_tokens=16) as llm:
        model = llm.engine.runner.model
        gdn = model.state_layers()[0]
        assert (gdn.hk, gdn.hv) == (1, 2)  # of 2 key heads and 4 value heads
        for _ in range(2):  # the second time from the prefix cache
            outs = llm.generate(prompts, p)
            for prompt, out in zip(prompts, outs):
                assert out.token_ids == hf_greedy(hf, prompt, 12)
                ours = torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.token_ids)])
                torch.testing.assert_close(ours, hf_logprobs(hf, prompt, out.token_ids), atol=1e-3, rtol=0)
            st = assert_no_leaks(llm)
        assert st["state_snapshot_hit_tokens"] > 0
        procs = [proc for _, proc in llm.engine.tp.procs]
    assert procs and all(proc.exitcode == 0 for proc in procs)


def test_gdn_heads_that_do_not_split_are_a_user_error(tmp_path):
    make_hybrid_checkpoint("qwen3_5_text", tmp_path, linear_num_key_heads=1, linear_num_value_heads=2)
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=16, tensor_parallel_size=2)
