"""The attention layer's L2 prefetch plumbing: which weights each layer's decode kernel is
told to prefetch, and the byte budget over them (the kernel side runs in the GPU tests)."""
import torch

from blitzllm.config import ModelConfig
from blitzllm.kernels._common import L2_PREFETCH_LANES, l2_prefetch_chunk
from blitzllm.layers.attention import l2_prefetch_ranges
from blitzllm.models.llama import LlamaForCausalLM


def _model(arch="Qwen3ForCausalLM", layers=3):
    cfg = ModelConfig(architecture=arch, vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=layers,
                      num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
    return LlamaForCausalLM(cfg)


def test_layers_prefetch_the_weights_decode_reads_next():
    m = _model()
    layers = m.model.layers
    for i, layer in enumerate(layers):
        mods = layer.self_attn.attn.prefetch_modules
        want = [layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        if i + 1 < len(layers):
            want.append(layers[i + 1].self_attn.qkv_proj)
        assert list(mods) == want
        # a plain tuple attribute: not submodules, so names and state_dict are unchanged
        assert not any(sub is mod for _, sub in layer.self_attn.attn.named_modules() for mod in want)
    assert set(m.state_dict()) == set(_model().state_dict())


def test_prefetch_ranges_fill_the_budget_in_order():
    m = _model(layers=2)
    mods = m.model.layers[0].self_attn.attn.prefetch_modules
    sizes = [mod.weight.numel() * mod.weight.element_size() for mod in mods]
    got = l2_prefetch_ranges(mods, 10 ** 9)
    assert [w for w, _ in got] == [mod.weight for mod in mods] and [n for _, n in got] == sizes
    budget = sizes[0] + sizes[1] // 2  # all of o_proj, then the head of gate_up
    got = l2_prefetch_ranges(mods, budget)
    assert [n for _, n in got] == [sizes[0], sizes[1] // 2]
    assert l2_prefetch_ranges(mods, 0) == []
    # a quantized module ends the list (its dense weight is not what decode reads)
    mods[1].qweight = torch.zeros(1, dtype=torch.uint8)
    assert [n for _, n in l2_prefetch_ranges(mods, 10 ** 9)] == [sizes[0]]


def test_prefetch_chunk_covers_the_range_in_one_round():
    for nbytes, programs in [(33554432, 256), (8 << 20, 8), (100, 1000), (1, 1)]:
        c = l2_prefetch_chunk(nbytes, programs)
        assert c % 16 == 0 and c >= 256
        assert c * programs * L2_PREFETCH_LANES >= nbytes
        assert c == 256 or (c - 16) * programs * L2_PREFETCH_LANES < nbytes  # no larger than needed


def test_moe_layers_prefetch_router_and_shared_experts():
    """An MoE block's layer prefetches o_proj, the router and the shared experts (DeepSeek
    style), a dense layer of the same model its own MLP and the next layer's qkv."""
    from blitzllm.layers.moe import FusedMoE
    from blitzllm.models.llama import DecoderLayer, DenseMLP
    from blitzllm.models.qwen3_moe import Qwen3MoeForCausalLM

    class WithShared(Qwen3MoeForCausalLM):
        def make_layer(self, cfg, idx, rotary):
            if idx == 0:
                return DecoderLayer(cfg, idx, rotary)
            moe = FusedMoE(cfg.hidden_size, 16, 4, 2, shared_experts=DenseMLP(cfg.hidden_size, 24))
            return DecoderLayer(cfg, idx, rotary, moe)

    cfg = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
    m = WithShared(cfg)
    dense, moe = m.model.layers
    assert list(dense.self_attn.attn.prefetch_modules) == [
        dense.self_attn.o_proj, dense.mlp.gate_up_proj, dense.mlp.down_proj, moe.self_attn.qkv_proj]
    assert list(moe.self_attn.attn.prefetch_modules) == [
        moe.self_attn.o_proj, moe.mlp.gate, moe.mlp.shared_experts.gate_up_proj, moe.mlp.shared_experts.down_proj]
    # the router's weight is a range like any other
    sizes = [n for _, n in l2_prefetch_ranges(moe.self_attn.attn.prefetch_modules, 10 ** 9)]
    assert sizes[1] == moe.mlp.gate.weight.numel() * moe.mlp.gate.weight.element_size()
