"""DeepSeek-V3 (MLA + grouped sigmoid MoE + YaRN) on tiny random checkpoints: greedy tokens
and logprobs match transformers; chunked prefill and prefix caching leave greedy output
unchanged; the cache holds only the latent; MTP weights load and are kept."""
import json

import pytest
import torch

from blitzllm import LLM, SamplingParams
from blitzllm.config import ModelConfig
from blitzllm.loader.source import PRESET_DIR
from tests.conftest import hf_greedy, hf_logprobs

TINY_DS = dict(vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
               q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
               n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2,
               first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
               max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.25, tie_word_embeddings=False)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
            beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.8)


def make_tiny_deepseek(path, seed=0, arch="DeepseekV3", base=None, **overrides):
    """A random DeepSeek-V3 (or transformers' ``arch`` on config ``base``) written with
    save_pretrained; correction biases random (not the zeros transformers starts from) so they
    steer expert selection."""
    import transformers
    torch.manual_seed(seed)
    kw = dict(base or TINY_DS, **overrides)
    kw.setdefault("rope_parameters", dict(YARN))
    model = getattr(transformers, f"{arch}ForCausalLM")(getattr(transformers, f"{arch}Config")(**kw)).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape) * 0.3)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def _prompts(lengths, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 320, (n,), generator=g).tolist() for n in lengths]


def _check_matches(llm, hf, prompts, n, atol=1e-4, rtol=1e-4):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, n)
        ours = torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.token_ids)])
        torch.testing.assert_close(ours, hf_logprobs(hf, prompt, out.token_ids), atol=atol, rtol=rtol)
    return outs


@pytest.mark.parametrize("variant", [
    dict(),                                                     # q LoRA, YaRN, n_group 4
    dict(q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=1, rope_interleave=False,
         rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
])
def test_tiny_deepseek_matches_transformers(variant, tmp_path):
    hf = make_tiny_deepseek(tmp_path, seed=1, **variant)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=64)
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert hasattr(attn, "q_b_proj") == (variant.get("q_lora_rank", 48) is not None)
    outs = _check_matches(llm, hf, _prompts((1, 5, 17, 40)), 16)
    assert len({t for o in outs for t in o.token_ids}) > 4  # not a degenerate constant output
    assert llm.stats()["kv_blocks_free"] == 64


def test_long_prompt_attention_in_row_chunks_matches_transformers(tmp_path, monkeypatch):
    """The prefill attention over expanded latents holds at most ``_SCORE_ELEMS`` scores at once
    (a long prompt's whole [H, Q, L] would not fit a GPU): with a bound of a few rows per chunk
    (and a 40-token prompt's last chunk short), greedy tokens and logprobs still match
    transformers."""
    from blitzllm.layers import mla
    monkeypatch.setattr(mla, "_SCORE_ELEMS", 4 * 40 * 3)  # 4 heads: 3 query rows a chunk at 40 keys
    calls = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: calls.append(a.shape) or real(a, b))
    hf = make_tiny_deepseek(tmp_path, seed=1)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=64)
    _check_matches(llm, hf, _prompts((40, 9)), 6)
    assert (4, 3, 24) in calls and not any(len(c) == 3 and c[0] == 4 and c[1] > 13 for c in calls)


def test_chunked_prefill_and_prefix_cache_keep_greedy_output(tmp_path):
    hf = make_tiny_deepseek(tmp_path, seed=2)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=64, block_size=4,
              max_num_batched_tokens=7)
    shared = _prompts((21,), seed=3)[0]
    prompts = [shared, shared[:13] + [5, 6, 7], _prompts((9,), seed=4)[0]]
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = llm.generate(prompts, p)
    again = llm.generate([shared], p)[0]  # its full blocks come from the prefix cache
    assert llm.stats()["prefix_cache_hit_tokens"] > 0
    for prompt, out in zip(prompts, first):
        assert out.token_ids == hf_greedy(hf, prompt, 10)
    assert again.token_ids == first[0].token_ids
    s = llm.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"] == 64


def _check_fused_prefill(tmp_path, device, atol, rtol):
    """Whole prompts, then 5-token chunks over earlier chunks and prefix-cache hits: transformers'
    greedy tokens and logprobs (within ``atol`` + ``rtol``); no KV block left behind."""
    hf = make_tiny_deepseek(tmp_path, seed=2)
    shared = _prompts((21,), seed=3)[0]
    prompts = [shared, shared[:13] + [5, 6, 7], _prompts((9,), seed=4)[0]]
    for chunk in (None, 5):
        llm = LLM(str(tmp_path), device=device, dtype="float32", kv_cache_blocks=64, block_size=4,
                  max_num_batched_tokens=chunk or 256)
        _check_matches(llm, hf, prompts, 8, atol, rtol)
        assert llm.stats()["kv_blocks_free"] == 64
        del llm


def test_fused_prefill_attention_matches_transformers(tmp_path, monkeypatch):
    """``attend_fused`` (CUDA's prefill: one SDPA call, causal mask aligned to the last query
    row) in place of the row-chunked reference, here on CPU: whole prompts, 5-token chunks over
    earlier chunks and prefix-cache hits give transformers' greedy tokens and logprobs."""
    from blitzllm.layers.mla import MLAttention
    shapes = []

    def fused(self, q, kv, qpos):
        assert qpos.tolist() == list(range(kv.shape[0] - q.shape[0], kv.shape[0]))
        shapes.append((q.shape[0], kv.shape[0]))
        return self.attend_fused(q, kv)
    monkeypatch.setattr(MLAttention, "attend_latents", fused)
    _check_fused_prefill(tmp_path, "cpu", 1e-4, 1e-4)
    assert (21, 21) in shapes and any(q < L for q, L in shapes)


@pytest.mark.gpu
def test_fused_prefill_on_cuda_matches_transformers(tmp_path, monkeypatch):
    """On CUDA (Triton kernels, CUDA graphs) the prefill takes ``attend_fused`` by itself: whole
    prompts and 5-token chunks over earlier chunks and prefix-cache hits give transformers' (CPU)
    greedy tokens, logprobs within 2e-3."""
    from blitzllm.layers.mla import MLAttention
    shapes, real = [], MLAttention.attend_fused
    monkeypatch.setattr(MLAttention, "attend_fused", lambda self, q, kv: shapes.append((q.shape[0], kv.shape[0]))
                        or real(self, q, kv))
    _check_fused_prefill(tmp_path, "cuda", 2e-3, 0)
    assert (21, 21) in shapes and any(q < L for q, L in shapes)


def test_cache_holds_only_the_latent(tmp_path):
    make_tiny_deepseek(tmp_path, seed=3, num_hidden_layers=2)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=8)
    caches = llm.engine.runner.kv_caches
    assert len(caches) == 2
    for latent, none in caches:
        assert latent.shape == (8, 16, 1, 32 + 8) and none is None
    cfg = llm.engine.model_config
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.kv_cache_entry) == (32, 8, (1, 1, 40))
    assert cfg.kv_bytes_per_token(4) == 2 * 40 * 4


def test_latent_cache_write_skips_padding_rows():
    from blitzllm.layers.mla import write_latent_cache
    cache = torch.zeros(2, 4, 1, 5)
    entry = torch.randn(4, 5)
    write_latent_cache(entry, cache, torch.tensor([5, -1, 2, -1]), padded=True)
    flat = cache.view(8, 5)
    assert torch.equal(flat[5], entry[0]) and torch.equal(flat[2], entry[2])
    assert flat[[0, 1, 3, 4, 6, 7]].abs().sum() == 0


def _add_mtp_weights(path, hf, seed=5):
    """Append a DeepSeek MTP module (checkpoint layer num_hidden_layers) to the checkpoint,
    as in DeepSeek's release: a full decoder layer + enorm/hnorm/eh_proj/shared_head and a
    copy of the embedding. Returns the added tensors."""
    from safetensors.torch import load_file, save_file
    n, h, v = hf.config.num_hidden_layers, hf.config.hidden_size, hf.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(str(path / "model.safetensors"))
    extra = {}
    for name, t in tensors.items():
        if name.startswith(f"model.layers.{n - 1}."):
            extra[name.replace(f"layers.{n - 1}.", f"layers.{n}.")] = torch.randn(t.shape, generator=g) * 0.1
    extra.update({f"model.layers.{n}.enorm.weight": torch.rand(h, generator=g),
                  f"model.layers.{n}.hnorm.weight": torch.rand(h, generator=g),
                  f"model.layers.{n}.eh_proj.weight": torch.randn(h, 2 * h, generator=g),
                  f"model.layers.{n}.shared_head.norm.weight": torch.rand(h, generator=g),
                  f"model.layers.{n}.shared_head.head.weight": torch.randn(v, h, generator=g),
                  f"model.layers.{n}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    save_file(extra, str(path / "model-mtp.safetensors"))
    return extra


@pytest.mark.parametrize("num_layers", [None, 1])
def test_mtp_weights_load_and_are_kept(tmp_path, num_layers):
    hf = make_tiny_deepseek(tmp_path, seed=4, num_hidden_layers=2)
    extra = _add_mtp_weights(tmp_path, hf)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=16, num_layers=num_layers)
    model = llm.engine.runner.model
    assert len(model.model.layers) == (num_layers or 2)
    mtp = model.mtp.layers[0]
    assert any(n.startswith("mtp.layers.0.shared_head.") for n, _ in model.named_parameters())
    assert type(mtp.mlp).__name__ == "FusedMoE"
    torch.testing.assert_close(mtp.eh_proj.weight, extra["model.layers.2.eh_proj.weight"], atol=0, rtol=0)
    torch.testing.assert_close(mtp.shared_head.head.weight, extra["model.layers.2.shared_head.head.weight"],
                               atol=0, rtol=0)
    a = mtp.self_attn
    torch.testing.assert_close(a.fused_qkv_a_proj.weight[a.fused_qkv_a_proj.shard_slice(1)],
                               extra["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"], atol=0, rtol=0)
    torch.testing.assert_close(mtp.mlp.w13[3, 32:], extra["model.layers.2.mlp.experts.3.up_proj.weight"],
                               atol=0, rtol=0)
    torch.testing.assert_close(mtp.mlp.gate.e_score_correction_bias,
                               extra["model.layers.2.mlp.gate.e_score_correction_bias"], atol=0, rtol=0)
    if num_layers is None:  # forward ignores the MTP layer
        _check_matches(llm, hf, _prompts((6, 11)), 8)


def test_preset_config_and_meta_build():
    """The shipped preset is the real DeepSeek-V3 shape: a latent cache entry of 576 values,
    YaRN scale, and a num_layers override builds (on the meta device: no memory)."""
    from blitzllm.models.deepseek_v3 import DeepseekV3ForCausalLM
    hf_cfg = json.loads((PRESET_DIR / "deepseek-v3.json").read_text())
    cfg = ModelConfig.from_hf(hf_cfg, num_layers=4)
    assert (cfg.num_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.kv_cache_entry) == (4, 512, 64, (1, 1, 576))
    assert cfg.kv_bytes_per_token(2) == 4 * 576 * 2
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["DenseMLP"] * 3 + ["FusedMoE"]
    moe = model.model.layers[3].mlp
    assert moe.w13.shape == (256, 4096, 7168) and (moe.n_group, moe.topk_group, moe.top_k) == (8, 4, 8)
    assert model.args.checkpoint_layers == 61 and model.args.num_mtp_layers == 1
    # 192^-0.5 * (0.1 ln 40 + 1)^2
    assert model.model.layers[0].self_attn.scale == pytest.approx(192 ** -0.5 * (0.1 * 2.302585 * 1.60206 + 1) ** 2,
                                                                   rel=1e-5)


@pytest.mark.parametrize("key,value", [("scoring_func", "softmax"), ("topk_method", "greedy")])
def test_v2_routing_config_is_refused(key, value):
    """A config asking for DeepSeek-V2's routing (softmax scores, greedy selection) under the V3
    architecture gets a ValueError, not V3's sigmoid routing in silence."""
    from blitzllm.models.deepseek_v3 import DeepseekV3ForCausalLM
    hf_cfg = dict(json.loads((PRESET_DIR / "deepseek-v3.json").read_text()), **{key: value})
    with torch.device("meta"), pytest.raises(ValueError, match=f"needs {key}"):
        DeepseekV3ForCausalLM(ModelConfig.from_hf(hf_cfg, num_layers=2))


def test_legacy_config_format_from_preset(tmp_path):
    """The preset's own keys (legacy ``rope_scaling`` with ``type: yarn``, no head_dim)
    shrunk to a tiny size: our reading of the config matches transformers'."""
    import transformers
    cfg = json.loads((PRESET_DIR / "deepseek-v3.json").read_text())
    cfg.update({k: TINY_DS[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                                         "num_attention_heads", "num_key_value_heads", "kv_lora_rank",
                                         "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                         "initializer_range")},
               num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=16, n_group=4, topk_group=2,
               num_experts_per_tok=4)
    cfg["rope_scaling"] = dict(cfg["rope_scaling"], original_max_position_embeddings=64)
    legacy = dict(cfg)
    torch.manual_seed(6)
    hf_kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "transformers_version")}
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**hf_kwargs)).float().eval()
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    (tmp_path / "config.json").write_text(json.dumps(legacy))  # keep the legacy layout on disk
    assert hf.model.rotary_emb.rope_type == "yarn"
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=32)
    _check_matches(llm, hf, _prompts((3, 20)), 8)


@pytest.mark.parametrize("rope", [
    dict(factor=40.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0),  # DeepSeek-V3
    dict(factor=4.0, original_max_position_embeddings=128, mscale=0.707, mscale_all_dim=1.0, beta_fast=16),
    dict(factor=8.0, original_max_position_embeddings=64, truncate=False),  # attention factor from factor
])
def test_yarn_tables_match_transformers(rope):
    """Our cos/sin cache (attention factor folded in) equals transformers' rotary output."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
    from blitzllm.layers.rotary import build_cos_sin_cache
    params = dict(rope, rope_type="yarn", rope_theta=10000.0)
    cfg = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=16,
                                        max_position_embeddings=512, rope_parameters=dict(params))
    cos, sin = DeepseekV3RotaryEmbedding(cfg)(torch.zeros(1), torch.arange(512)[None])
    ours = build_cos_sin_cache(16, 512, 10000.0, params)
    torch.testing.assert_close(ours, torch.cat([cos[0, :, :8], sin[0, :, :8]], -1), atol=0, rtol=0)
