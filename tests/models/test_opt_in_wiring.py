"""Opt-in CUDA decode paths wired by the models, checked on the CPU reference path: the
switches mark the right modules, the layers hand the kernels what they need, and the
outputs stay those of the default path (the CPU path ignores what only CUDA uses)."""
import pytest
import torch

from blitzllm import LLM, SamplingParams
from blitzllm.layers.moe import FusedMoE
from tests.models.test_moe_models import make_moe_checkpoint


def _greedy(llm):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (k,), generator=g).tolist() for k in (1, 6)]
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]


@pytest.mark.parametrize("mode", ["1", "qkvo"])
def test_moe_pf_qkv_hands_the_next_layers_weights_to_the_routing_launch(tmp_path, monkeypatch, mode):
    """BLITZ_MOE_PF_QKV: each MoE block's norm + router call receives the next layer's qkv weight
    (=qkvo: and its o_proj weight) as its prefetch, the last layer none, in layer order, every
    decode step; greedy tokens as without the switch."""
    from blitzllm.kernels import moe as moe_ops
    make_moe_checkpoint("qwen3_moe", tmp_path, seed=2)
    want = _greedy(LLM(str(tmp_path), device="cpu", kv_cache_blocks=64))
    monkeypatch.setattr(moe_ops, "MOE_PF_QKV", True)
    monkeypatch.setattr(moe_ops, "_MOE_PF_QKV", mode)
    monkeypatch.setattr(FusedMoE, "norm_route_ok", lambda self, x, residual, norm: residual is not None)
    seen = []
    orig = moe_ops.norm_route_experts
    monkeypatch.setattr(moe_ops, "norm_route_experts", lambda *a, prefetch=(), **k: seen.append(prefetch) or
                        orig(*a, prefetch=prefetch, **k))
    llm = LLM(str(tmp_path), device="cpu", kv_cache_blocks=64)
    layers = llm.engine.runner.model.model.layers
    expect = [(nxt.self_attn.qkv_proj.weight,) + ((nxt.self_attn.o_proj.weight,) if mode == "qkvo" else ())
              for nxt in layers[1:]] + [()]
    seen.clear()
    assert _greedy(llm) == want
    assert seen and len(seen) % len(layers) == 0
    for i, p in enumerate(seen):
        want_p = expect[i % len(layers)]
        assert len(p) == len(want_p) and all(a is b for a, b in zip(p, want_p))


def test_oproj_partials_marks_single_rank_o_projs_and_keeps_outputs(tmp_path, monkeypatch):
    """BLITZ_ATTN_OPROJ: every decoder attention's plain o_proj is marked and each layer asks the
    backend for the merged projection (the torch backend has none: the two ops run apart);
    greedy tokens as without the switch."""
    from blitzllm.kernels import oproj_partials as op
    from blitzllm.layers.attention import Attention
    make_moe_checkpoint("qwen3_moe", tmp_path, seed=4)
    base = LLM(str(tmp_path), device="cpu", kv_cache_blocks=64)
    assert not any(layer.self_attn.oproj_partials for layer in base.engine.runner.model.model.layers)
    want = _greedy(base)
    monkeypatch.setattr(op, "OPROJ_PARTIALS", True)
    asked = []
    orig = Attention.forward_project
    monkeypatch.setattr(Attention, "forward_project", lambda self, *a: asked.append(self.layer_idx) or orig(self, *a))
    llm = LLM(str(tmp_path), device="cpu", kv_cache_blocks=64)
    layers = llm.engine.runner.model.model.layers
    assert all(layer.self_attn.oproj_partials for layer in layers)
    asked.clear()
    assert _greedy(llm) == want
    assert asked[:len(layers)] == list(range(len(layers)))
