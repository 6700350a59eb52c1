"""weight_dtype='fp8' (block-FP8 linears and experts, W8A16) on the CPU path: a tiny dense,
Qwen3-MoE, MiniMax-M2 and DeepSeek-V3 checkpoint run with FP8 weights gives the greedy tokens
and logprobs transformers gives with the dequantized weights (the model's own FP8 values and
scales, widened, exported and loaded into transformers); an FP8 checkpoint comes back to its
stored values exactly; the roofline counts the FP8 bytes; what is left unquantized."""
import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from blitzllm import LLM
from blitzllm.bench.roofline import expected_active_experts, weight_bytes_per_step
from blitzllm.kernels import fp8_weights
from blitzllm.kernels.fp8_weights import FP8_DTYPE, dequantize
from blitzllm.layers.linear import Linear
from blitzllm.layers.moe import FusedMoE
from blitzllm.loader.weights import export_hf_state_dict
from tests.conftest import make_tiny_checkpoint
from tests.models.test_deepseek_v3 import make_tiny_deepseek
from tests.models.test_fp8_checkpoints import quantize_checkpoint
from tests.models.test_moe_models import check_matches_transformers, make_moe_checkpoint

BLOCK = (16, 32)  # several blocks per matrix at these sizes, ragged where a size is not a multiple


def dequantized_copy(model):
    """The model with every FP8 weight widened back to fp32 (what its kernels multiply)."""
    m = copy.deepcopy(model)
    for mod in m.modules():
        if isinstance(mod, Linear) and mod.fp8_block is not None:
            mod.weight = torch.nn.Parameter(dequantize(mod.weight, mod.weight_scale_inv, mod.fp8_block, torch.float32),
                                            requires_grad=False)
            mod.weight_scale_inv, mod.fp8_block = None, None
        elif isinstance(mod, FusedMoE) and mod.fp8_block is not None:
            for name in ("w13", "w2"):
                w = dequantize(getattr(mod, name), getattr(mod, f"{name}_scale_inv"), mod.fp8_block, torch.float32)
                setattr(mod, name, torch.nn.Parameter(w, requires_grad=False))
            mod.fp8_block = None
    return m


def transformers_on(model, src, dst):
    """transformers loading ``model``'s weights (checkpoint names) with ``src``'s config."""
    import transformers
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in export_hf_state_dict(model, per_expert=True).items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    return transformers.AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "minimax_m2", "deepseek_v3"])
def test_fp8_weights_match_transformers_on_their_dequantized_values(tmp_path, arch, monkeypatch):
    monkeypatch.setattr(fp8_weights, "WEIGHT_BLOCK", BLOCK)
    ck = tmp_path / "ck"
    if arch == "qwen3":
        make_tiny_checkpoint(arch, ck, seed=3)
    elif arch == "deepseek_v3":
        make_tiny_deepseek(ck, seed=3)
    else:
        make_moe_checkpoint(arch, ck, seed=3)
    llm = LLM(str(ck), device="cpu", dtype="float32", kv_cache_blocks=16, weight_dtype="fp8")
    model = llm.engine.runner.model
    quantized = [n for n, p in model.named_parameters() if p.dtype == FP8_DTYPE]
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert quantized and all(m.fp8_block == BLOCK and m.w13.dtype == m.w2.dtype == FP8_DTYPE for m in moe)
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32
    assert all(m.gate.weight.dtype == torch.float32 for m in moe)
    hf = transformers_on(dequantized_copy(model), ck, tmp_path / "deq")
    check_matches_transformers(hf, ck, lengths=(1, 6, 23), n=10, weight_dtype="fp8")


def test_fp8_checkpoint_values_come_back_exactly(tmp_path):
    """An FP8 checkpoint (DeepSeek's recipe, block 16 x 32) run with weight_dtype='fp8':
    dequantized on load, then quantized again on the checkpoint's own block grid, every
    stored float8 value comes back, and each scale to within the bf16-free fp32 rounding."""
    from safetensors import safe_open
    make_moe_checkpoint("qwen3_moe", tmp_path, seed=9)
    quantize_checkpoint(tmp_path, block=BLOCK)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=8, weight_dtype="fp8")
    o_proj = llm.engine.runner.model.model.layers[1].self_attn.o_proj
    assert o_proj.fp8_block == BLOCK
    stored = {}
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as sf:
            stored.update({k: sf.get_tensor(k) for k in sf.keys() if "layers.1.self_attn.o_proj" in k})
    assert torch.equal(o_proj.weight.view(torch.uint8), stored["model.layers.1.self_attn.o_proj.weight"].view(torch.uint8))
    torch.testing.assert_close(o_proj.weight_scale_inv, stored["model.layers.1.self_attn.o_proj.weight_scale_inv"],
                               rtol=1e-6, atol=0)


def test_ue8m0_checkpoint_comes_back_exactly_through_bf16(tmp_path):
    """An FP8 checkpoint with power-of-two scales (``scale_fmt: ue8m0``) run in bf16 with
    weight_dtype='fp8': each value times a power of two is exact in bf16, so quantizing again
    with power-of-two scales gives back every stored weight exactly, the experts' too (a block
    whose largest value rounded down to 224 comes back as twice the values at half the scale:
    the same products)."""
    from safetensors import safe_open
    make_moe_checkpoint("qwen3_moe", tmp_path, seed=10)
    quantize_checkpoint(tmp_path, block=BLOCK, scale_fmt="ue8m0")
    model = LLM(str(tmp_path), device="cpu", dtype="bfloat16", kv_cache_blocks=8,
                weight_dtype="fp8").engine.runner.model
    stored = {}
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as sf:
            stored.update({k: sf.get_tensor(k) for k in sf.keys() if k.startswith("model.layers.1.")})
    o_proj, moe = model.model.layers[1].self_attn.o_proj, model.model.layers[1].mlp
    key = "model.layers.1.self_attn.o_proj.weight"
    down = "model.layers.1.mlp.experts.5.down_proj.weight"
    for q, s, name in ((o_proj.weight, o_proj.weight_scale_inv, key), (moe.w2[5], moe.w2_scale_inv[5], down)):
        assert torch.equal(dequantize(q, s, BLOCK, torch.float32),
                           dequantize(stored[name], stored[name + "_scale_inv"], BLOCK, torch.float32))
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    assert torch.equal(torch.exp2(torch.log2(moe.w13_scale_inv).round()), moe.w13_scale_inv)


def test_fp8_roofline_bytes(tmp_path, monkeypatch):
    """weight_bytes_per_step counts one byte per FP8 weight plus its scales (experts at their
    expected active share), the unquantized parameters at their own size."""
    monkeypatch.setattr(fp8_weights, "WEIGHT_BLOCK", BLOCK)
    make_moe_checkpoint("qwen3_moe", tmp_path, seed=2)
    model = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=8, weight_dtype="fp8").engine.runner.model
    share = {}
    for m in model.modules():
        if isinstance(m, FusedMoE):
            frac = expected_active_experts(m.num_experts, m.top_k, 1) / m.num_experts
            for t in (m.w13, m.w2, m.w13_scale_inv, m.w2_scale_inv):
                share[id(t)] = frac
    expect = 0.0
    for name, p in model.named_parameters():
        if p is model.model.embed_tokens.weight:
            expect += p.shape[1] * 4
        else:
            expect += p.numel() * p.element_size() * share.get(id(p), 1.0)
    for name, b in model.named_buffers():
        if name.endswith("scale_inv"):
            assert b.dtype == torch.float32
            expect += b.numel() * 4 * share.get(id(b), 1.0)
    assert weight_bytes_per_step(model, 1) == int(expect)
    assert any(p.dtype == FP8_DTYPE and p.element_size() == 1 for p in model.parameters())


def test_weight_dtype_errors(tmp_path):
    make_tiny_checkpoint("qwen3", tmp_path, seed=1)
    with pytest.raises(ValueError, match="weight_dtype must be one of"):
        LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=8, weight_dtype="fp9")


def test_fp8_config_block_is_taken(tmp_path):
    """The block comes from the checkpoint's quantization_config where it has one."""
    make_moe_checkpoint("qwen3_moe", tmp_path, seed=4)
    quantize_checkpoint(tmp_path, block=(8, 16))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [8, 16]
    model = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=8, weight_dtype="fp8").engine.runner.model
    assert {m.fp8_block for m in model.modules() if isinstance(m, (Linear, FusedMoE)) and m.fp8_block} == {(8, 16)}
