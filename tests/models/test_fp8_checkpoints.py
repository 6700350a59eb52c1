"""FP8 block-quantized checkpoints (the format of DeepSeek-V3 / MiniMax-M2 / Qwen3 "-FP8"
releases): tiny random DeepSeek-V3, MiniMax-M2 and Qwen3-MoE checkpoints written with
save_pretrained, their linear weights then quantized to float8 e4m3 with one fp32
``weight_scale_inv`` per block (as DeepSeek's quantizer forms them) and split over two
shards so some scales lie in another file than their weights, give the same greedy tokens
and logprobs as transformers loading the same FP8 folder (it dequantizes on a CPU); the
block dequantization (ragged grids, E8M0 scales) against a per-block loop; bad checkpoints
get a ValueError."""
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from blitzllm.loader.fp8 import dequantize_fp8_block, dequantize_stream, fp8_block_size
from blitzllm.loader.source import resolve_model
from tests.models.test_deepseek_v3 import make_tiny_deepseek
from tests.models.test_moe_models import check_matches_transformers, make_moe_checkpoint

FP8_MAX = 448.0  # float8 e4m3's largest finite value


def quantize_block(w: torch.Tensor, block, pow2: bool = False) -> tuple:
    """DeepSeek's recipe, one block at a time: scale = amax / 448 (``pow2``: rounded up to a
    power of two, as ``scale_fmt: ue8m0``), q = fp8(w / scale)."""
    bn, bk = block
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-n // bn), -(-k // bk))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            s[i, j] = tile.abs().max().clamp(min=1e-12) / FP8_MAX
            if pow2:
                s[i, j] = 2.0 ** math.ceil(math.log2(s[i, j].item()))
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def reference_dequant(q: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    bn, bk = block
    out = torch.empty(q.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float() * s[i, j]
    return out


def _quantized(name: str, t: torch.Tensor) -> bool:
    """The tensors the released checkpoints keep in FP8: every linear of attention, dense MLPs
    and experts; not embeddings, lm_head, norms, routers or biases."""
    if t.dim() != 2 or not name.endswith(".weight") or "norm" in name:
        return False
    leaf = name.rsplit(".", 2)[-2]
    return leaf not in ("embed_tokens", "lm_head", "gate")


def quantize_checkpoint(path, block, scale_fmt=None) -> dict:
    """Rewrite ``path``'s save_pretrained weights in the FP8 block format, in two shards (every
    other scale in the shard after its weight's) with an index; returns the original tensors.
    ``scale_fmt="ue8m0"``: power-of-two scales, named so in the config."""
    orig = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    shards: list = [{}, {}]
    for i, (name, t) in enumerate(sorted(orig.items())):
        if _quantized(name, t):
            q, s = quantize_block(t, block, pow2=scale_fmt == "ue8m0")
            shards[0][name] = q
            shards[i % 2][name[:-len("weight")] + "weight_scale_inv"] = s
        else:
            shards[i % 2][name] = t
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for f, sd in zip(files, shards):
        save_file(sd, str(path / f), metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, sd in zip(files, shards) for n in sd}}))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": list(block)}
    if scale_fmt is not None:
        cfg["quantization_config"]["scale_fmt"] = scale_fmt
    (path / "config.json").write_text(json.dumps(cfg))
    return orig


def _transformers_fp8(path):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["deepseek_v3", "minimax_m2", "qwen3_moe"])
def test_fp8_checkpoint_matches_transformers(tmp_path, arch):
    if arch == "deepseek_v3":
        make_tiny_deepseek(tmp_path, seed=4)
    else:
        make_moe_checkpoint(arch, tmp_path, seed=4)
    orig = quantize_checkpoint(tmp_path, block=(8, 16))  # (transformers' dequantization needs whole blocks)
    hf = _transformers_fp8(tmp_path)
    # the quantization is real: transformers' weights are the dequantized ones, not the originals
    name = "model.layers.0.self_attn.o_proj.weight"
    hf_w = hf.get_parameter(name)
    assert not torch.equal(hf_w, orig[name])
    torch.testing.assert_close(hf_w, orig[name], atol=0.1 * orig[name].abs().max().item(), rtol=0.1)
    llm = check_matches_transformers(hf, tmp_path, lengths=(1, 6, 23), n=10)
    assert torch.equal(llm.engine.runner.model.get_parameter(name), hf_w)


def test_fp8_lazy_slices_dequantize_alike(tmp_path):
    """The tensor-parallel loader's lazy slices come out of the FP8 stream as the same tensors."""
    make_tiny_deepseek(tmp_path, seed=6)
    quantize_checkpoint(tmp_path, block=(16, 32))
    src = resolve_model(str(tmp_path))
    full = dict(src.tensors())
    lazy = {n: (t if isinstance(t, torch.Tensor) else t[:]) for n, t in src.slices()}
    assert full.keys() == lazy.keys() and not any(n.endswith("_scale_inv") for n in full)
    assert all(torch.equal(full[n], lazy[n]) for n in full)
    assert {t.dtype for t in full.values()} == {torch.float32}


@pytest.mark.parametrize("shape,block", [((576, 200), (128, 128)), ((3, 40, 24), (16, 16)), ((7, 5), (4, 8))])
def test_dequantize_ragged_blocks(shape, block):
    """Grids rounded up (V3's 576-row kv_a_proj_with_mqa in 128-blocks), stacked experts."""
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.rand(shape[:-2] + (1, shape[-1])) * 3
    qs = [quantize_block(m, block) for m in w.reshape(-1, *shape[-2:])]
    q = torch.stack([a for a, _ in qs]).reshape(shape)
    s = torch.stack([b for _, b in qs]).reshape(shape[:-2] + qs[0][1].shape)
    ref = torch.stack([reference_dequant(a, b, block) for a, b in qs]).reshape(shape)
    got = dequantize_fp8_block(q, s, block)
    assert got.dtype == torch.float32 and torch.equal(got, ref)
    assert (got - w).abs().max() <= w.abs().max() / 8  # e4m3 keeps 3 mantissa bits


def test_dequantize_e8m0_scales():
    """Power-of-two scales stored as E8M0 exponent bytes (2 ** (b - 127))."""
    q = torch.tensor([[1.5, -2.0], [0.25, 3.0]]).to(torch.float8_e4m3fn)
    e = torch.tensor([[127 + 3, 127 - 2]], dtype=torch.uint8)  # blocks of [2, 1]: scales 8, 1/4
    got = dequantize_fp8_block(q, e, (2, 1))
    assert torch.equal(got, torch.tensor([[12.0, -0.5], [2.0, 0.75]]))


def _pairs(*items):
    return iter(items)


def test_fp8_stream_errors():
    q = torch.zeros(4, 4).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="has no 'a.weight_scale_inv'"):
        list(dequantize_stream(_pairs(("a.weight", q)), (2, 2)))
    with pytest.raises(ValueError, match="scales no FP8 weight"):
        list(dequantize_stream(_pairs(("a.weight_scale_inv", torch.ones(2, 2))), (2, 2)))
    with pytest.raises(ValueError, match="does not fit"):
        list(dequantize_stream(_pairs(("a.weight_scale_inv", torch.ones(3, 2)), ("a.weight", q)), (2, 2)))
    # scale before or after its weight, other tensors untouched and in order
    out = list(dequantize_stream(_pairs(("a.weight_scale_inv", torch.full((2, 2), 2.0)), ("n.weight", torch.ones(4)),
                                        ("a.weight", torch.ones(4, 4).to(q.dtype)), ("b.weight", q), ("b.weight_scale_inv", torch.ones(2, 2))),
                                 (2, 2)))
    assert [n for n, _ in out] == ["n.weight", "a.weight", "b.weight"]
    assert torch.equal(out[1][1], torch.full((4, 4), 2.0))


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "not supported"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "e4m3"}, "scale_fmt"),
])
def test_unsupported_quantization_configs(qc, match):
    with pytest.raises(ValueError, match=match):
        fp8_block_size({"quantization_config": qc})
    assert fp8_block_size({}) is None
    assert fp8_block_size({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}}) == (128, 64)


def test_fp8_tensor_without_quantization_config(tmp_path):
    """A float8 weight in a checkpoint whose config.json names no FP8 quantization would load
    as raw values: the engine refuses it."""
    from blitzllm import LLM
    make_moe_checkpoint("qwen3_moe", tmp_path, seed=8)
    quantize_checkpoint(tmp_path, block=(16, 16))
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="float8 but config.json has no FP8"):
        LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=16)
