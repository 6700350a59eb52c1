"""LoRA under tensor parallelism (two CPU ranks, gloo): each rank holds its part of every slot
(column-parallel q/k/v and gate/up: rows of B; row-parallel o and down: columns of A), and the
workers get rank 0's slot loads in its step broadcasts. Every request's tokens and logprobs are
transformers' on the checkpoint with its adapter merged, through a slot reused by another adapter
and beside base-model rows."""
import pytest
import torch

from blitzllm import LLM, LoRARequest, SamplingParams
from tests.conftest import hf_greedy, hf_logprobs, make_tiny_checkpoint
from tests.lora_adapters import ALL, ATTN, make_adapter, merged_model

N = 8
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("arch,overrides", [
    # one KV head for two ranks (k/v replicated: both ranks hold all of their B), a tied lm_head
    ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    ("qwen2", dict()),   # q/k/v bias, KV heads split
])
def test_adapters_tp2_match_the_merged_models(tmp_path, arch, overrides):
    hf = make_tiny_checkpoint(arch, tmp_path / "model", seed=3, **overrides)
    loras, oracles = [], []
    for i, (targets, r) in enumerate([(ALL, 8), (ATTN, 4)]):
        make_adapter(tmp_path / f"a{i}", hf, targets=targets, r=r, seed=10 + i)
        loras.append(LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}")))
        oracles.append(merged_model(tmp_path / "model", tmp_path / f"a{i}"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in (4, 19, 33, 9, 26)]
    which = [0, None, 1, 0, 1]
    # one slot: the second adapter's requests wait, then take the slot over (a load the workers copy)
    with LLM(str(tmp_path / "model"), device="cpu", dtype="float32", kv_cache_blocks=64, enable_lora=True,
             max_loras=1, tensor_parallel_size=2) as llm:
        outs = llm.generate(prompts, GREEDY, lora_request=[None if w is None else loras[w] for w in which])
        st = llm.stats()
        procs = [p for _, p in llm.engine.tp.procs]
    assert st["lora_slot_loads"] >= 2 and st["kv_blocks_free"] == st["kv_blocks_total"]
    for prompt, w, out in zip(prompts, which, outs):
        oracle = hf if w is None else oracles[w]
        got = out.outputs[0]
        assert got.token_ids == hf_greedy(oracle, prompt, N), (w, prompt)
        want = hf_logprobs(oracle, prompt, got.token_ids)
        lps = torch.tensor([lp[t] for lp, t in zip(got.logprobs, got.token_ids)])
        torch.testing.assert_close(lps, want, atol=1e-4, rtol=1e-4)
    # the adapters changed the model
    assert any(o.outputs[0].token_ids != hf_greedy(hf, p, N) for p, w, o in zip(prompts, which, outs) if w is not None)
    assert procs and all(p.exitcode == 0 for p in procs)
