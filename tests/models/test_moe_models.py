"""Qwen3-MoE and MiniMax-M2 on the CPU reference path: tiny random checkpoints written with
transformers' save_pretrained give the same greedy tokens and logprobs as transformers;
both expert layouts load; the HF-peer export maps back onto transformers; presets build;
dummy weights route tokens evenly over the experts."""
import pytest
import torch

from blitzllm import LLM, SamplingParams
from blitzllm.config import ModelConfig
from blitzllm.layers.moe import FusedMoE
from blitzllm.loader.source import resolve_model
from blitzllm.loader.weights import export_hf_state_dict
from blitzllm.models.registry import get_model_class
from tests.conftest import hf_greedy, hf_logprobs

COMMON = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.25, tie_word_embeddings=False)
QWEN3_MOE = dict(COMMON, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=True, rope_theta=10000.0)
MINIMAX_M2 = dict(COMMON, intermediate_size=32, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=3,
                  rotary_dim=8, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)


def make_moe_checkpoint(arch: str, path, seed: int = 0, **overrides):
    """A tiny random checkpoint written by save_pretrained (fp32). Norm weights and the
    routing bias get random values too (transformers initialises them to 1 and 0), so a
    wrong norm width or an ignored bias shows in the outputs."""
    import transformers
    torch.manual_seed(seed)
    if arch == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**dict(QWEN3_MOE, **overrides)))
    elif arch == "minimax_m2":
        model = transformers.MiniMaxM2ForCausalLM(transformers.MiniMaxM2Config(**dict(MINIMAX_M2, **overrides)))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if "norm" in name:
                t.normal_(1.0, 0.2)
            elif name.endswith("e_score_correction_bias"):
                t.normal_(0.0, 0.1)
    model = model.float().eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def check_matches_transformers(hf, path, lengths=(1, 5, 17, 40), n=16, **llm_kw):
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_blocks=64, **llm_kw)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 320, (k,), generator=g).tolist() for k in lengths]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, n)
        ours = torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.token_ids)])
        torch.testing.assert_close(ours, hf_logprobs(hf, prompt, out.token_ids), atol=1e-4, rtol=1e-4)
    assert llm.stats()["kv_blocks_free"] == 64
    return llm


def _sparse_layers(llm) -> list:
    return [i for i, layer in enumerate(llm.engine.runner.model.model.layers)
            if any(isinstance(m, FusedMoE) for m in layer.children())]


@pytest.mark.parametrize("overrides,sparse", [
    (dict(mlp_only_layers=[2]), [0, 1, 3]),                                   # one dense layer
    (dict(decoder_sparse_step=2, norm_topk_prob=False, num_experts_per_tok=3), [1, 3]),
])
def test_qwen3_moe_matches_transformers(tmp_path, overrides, sparse):
    hf = make_moe_checkpoint("qwen3_moe", tmp_path, seed=1, **overrides)
    llm = check_matches_transformers(hf, tmp_path)
    assert _sparse_layers(llm) == sparse


def test_minimax_m2_matches_transformers(tmp_path):
    hf = make_moe_checkpoint("minimax_m2", tmp_path, seed=2)
    llm = check_matches_transformers(hf, tmp_path)
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (4 * 16,) and attn.k_norm.weight.shape == (2 * 16,)
    assert attn.attn.rotary.rotary_dim == 8
    assert _sparse_layers(llm) == [0, 1]


@pytest.mark.parametrize("arch", ["qwen3_moe", "minimax_m2"])
def test_norm_route_decode_matches_transformers(tmp_path, arch, monkeypatch):
    """FusedMoE.forward_norm (the post-attention residual add + norm handed to the routing; on
    CUDA decode the norm and the router GEMM in one launch) forced on for every step of up to 4
    tokens, here through its torch composition: the same greedy tokens and logprobs as
    transformers, and it ran."""
    calls = []
    monkeypatch.setattr(FusedMoE, "norm_route_ok",
                        lambda self, x, residual, norm: residual is not None and 0 < x.shape[0] <= 4)
    orig = FusedMoE.forward_norm
    monkeypatch.setattr(FusedMoE, "forward_norm", lambda self, *a: calls.append(a[0].shape[0]) or orig(self, *a))
    hf = make_moe_checkpoint(arch, tmp_path, seed=5)
    check_matches_transformers(hf, tmp_path, lengths=(1, 5, 17), n=10)
    assert calls and max(calls) <= 4


@pytest.mark.parametrize("arch", ["qwen3_moe", "minimax_m2"])
def test_fp32_moe_sums_round_like_the_rounded_sum(tmp_path, arch, monkeypatch):
    """The contract behind the atomic MoE combine of CUDA decode: an MoE block that hands the
    next residual add + RMSNorm (or the final norm) its fp32 sum unrounded (``FusedMoE.fp32_sum``,
    wired on every block here) gives exactly the results of the rounded sum, since the norm
    rounds it first. bf16 on the torch path: the same greedy tokens, logprobs and EAGLE-3
    layer features (hooks see the rounded output) with the fp32 sums as with them switched off,
    and fp32 sums did reach the norms."""
    from blitzllm.kernels.moe import router as moe_ops
    from blitzllm.spec.hidden import HiddenCapture
    make_moe_checkpoint(arch, tmp_path, seed=11)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (k,), generator=g).tolist() for k in (1, 6, 19)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    dtypes = []
    orig = moe_ops.fused_moe
    monkeypatch.setattr(moe_ops, "fused_moe", lambda *a, **k: dtypes.append((out := orig(*a, **k)).dtype) or out)
    runs = []
    for fp32 in (True, False):
        llm = LLM(str(tmp_path), device="cpu", dtype="bfloat16", kv_cache_blocks=64)
        model = llm.engine.runner.model
        blocks = [m for m in model.modules() if isinstance(m, FusedMoE)]
        assert blocks and all(b.fp32_sum for b in blocks)
        for b in blocks:
            b.fp32_sum = fp32
        dtypes.clear()
        with HiddenCapture(model, [0, len(model.model.layers) - 1]) as cap:
            outs = llm.generate(prompts, params)
            feats, _ = cap.take()
        assert set(dtypes) == ({torch.float32} if fp32 else {torch.bfloat16})
        runs.append(([o.token_ids for o in outs], [o.logprobs for o in outs], feats))
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1]
    assert torch.equal(runs[0][2], runs[1][2])


@pytest.mark.parametrize("arch", ["qwen3_moe", "minimax_m2"])
def test_fused_expert_layout_and_num_layers(tmp_path, arch):
    """transformers' in-memory layout (fused experts.gate_up_proj / down_proj; MiniMax's
    ``mlp.`` module name) loads to the same weights as the per-expert checkpoint; a
    num_layers override skips the experts of the layers it drops."""
    from safetensors.torch import save_file
    hf = make_moe_checkpoint(arch, tmp_path / "per_expert", seed=3)
    fused = tmp_path / "fused"
    fused.mkdir()
    sd = hf.state_dict()
    assert any(k.endswith("experts.gate_up_proj") for k in sd)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(fused / "model.safetensors"))
    (fused / "config.json").write_text((tmp_path / "per_expert" / "config.json").read_text())
    a = LLM(str(tmp_path / "per_expert"), device="cpu", dtype="float32", kv_cache_blocks=8)
    b = LLM(str(fused), device="cpu", dtype="float32", kv_cache_blocks=8)
    pa = dict(a.engine.runner.model.named_parameters())
    pb = dict(b.engine.runner.model.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    one = LLM(str(tmp_path / "per_expert"), device="cpu", dtype="float32", kv_cache_blocks=8, num_layers=1)
    assert len(one.engine.runner.model.model.layers) == 1
    assert torch.equal(one.engine.runner.model.model.layers[0].get_submodule(_moe_name(arch)).w13,
                       pa[f"model.layers.0.{_moe_name(arch)}.w13"])


def _moe_name(arch):
    return "block_sparse_moe" if arch == "minimax_m2" else "mlp"


@pytest.mark.parametrize("arch", ["qwen3_moe", "minimax_m2"])
def test_export_hf_state_dict(tmp_path, arch):
    """The default export loads into a transformers model (the HF peer benchmark) and gives
    its logits; the per-expert export has exactly the names save_pretrained wrote."""
    from safetensors import safe_open

    from blitzllm.bench.hf_peer import build_hf_peer
    hf = make_moe_checkpoint(arch, tmp_path, seed=4)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=8)
    model, cfg = llm.engine.runner.model, llm.engine.model_config
    peer = build_hf_peer(model, cfg)
    ids = torch.randint(3, 320, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(peer(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        on_disk = set(f.keys())
    per_expert = export_hf_state_dict(model, per_expert=True)
    assert set(per_expert) == on_disk
    up = "w3" if arch == "minimax_m2" else "up_proj"
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        for key in (f"model.layers.1.{_moe_name(arch)}.experts.5.{up}.weight", "model.layers.0.self_attn.k_proj.weight"):
            assert torch.equal(per_expert[key], f.get_tensor(key))


PRESET_PARAMS = {  # total parameters of the published models (embedding + lm_head included)
    "qwen3-30b-a3b": 30.53e9,   # "30.5B total, 3.3B activated"
    "minimax-m2": 228.7e9,      # "230B total, 10B active"
}


@pytest.mark.parametrize("preset", sorted(PRESET_PARAMS))
def test_presets_build(preset):
    """The preset configs describe the real models: the model built on the meta device
    (no memory) has the published parameter count; a num_layers override cuts layers."""
    src = resolve_model(f"preset:{preset}")
    cfg = ModelConfig.from_hf(src.hf_config)
    with torch.device("meta"):
        model = get_model_class(cfg.architecture)(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert abs(total - PRESET_PARAMS[preset]) / PRESET_PARAMS[preset] < 0.01, total
    cut = ModelConfig.from_hf(src.hf_config, num_layers=2)
    with torch.device("meta"):
        small = get_model_class(cut.architecture)(cut)
    assert len(small.model.layers) == 2
    assert all(isinstance(layer.get_submodule(layer.mlp_name), FusedMoE) for layer in small.model.layers)


def test_dummy_routing_balanced(tmp_path):
    """Dummy weights spread tokens evenly over the experts. 128 random prompts of 8 tokens
    (1024 tokens, top-4 of 32 experts) through a 2-layer dummy Qwen3-MoE: each expert's
    expected load is 1024 * 4 / 32 = 128. For independent uniform choices (simulated,
    4000 draws) the max/min load ratio is 1.42 at the median and 1.74 at the 99.9th
    percentile; chi-square per degree of freedom 0.88 and 1.94. Bounds: ratio < 2.0 and
    chi2/dof < 2.5, room for the mild correlation of tokens that share a prompt. (Over 8
    dummy seeds: ratio <= 1.72, chi2/dof <= 1.8. The earlier init, embedding std 0.02 and
    plain Gaussian routers: ratio 3-4.4, chi2/dof 9-18.)"""
    make_moe_checkpoint("qwen3_moe", tmp_path, hidden_size=128, num_hidden_layers=2, num_experts=32,
                        num_experts_per_tok=4, vocab_size=4096)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=128, load_format="dummy")
    counts = {}

    def record(name):
        def hook(mod, args):
            ids = mod.route(args[0])[1].flatten().long()
            counts[name] = counts.get(name, 0) + torch.bincount(ids, minlength=mod.num_experts)
        return hook

    for name, mod in llm.engine.runner.model.named_modules():
        if isinstance(mod, FusedMoE):
            mod.register_forward_pre_hook(record(name))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4096, (8,), generator=g).tolist() for _ in range(128)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
    assert len(counts) == 2
    for name, c in counts.items():
        c = c.float()
        assert c.sum() == 1024 * 4
        m = c.mean()
        chi2_dof = ((c - m) ** 2 / m).sum() / (len(c) - 1)
        ratio = c.max() / c.min()
        print(f"{name}: loads {c.int().tolist()} max/min {ratio:.2f} chi2/dof {chi2_dof:.2f}")
        assert ratio < 2.0 and chi2_dof < 2.5, (name, c.tolist())
