"""Integer- and FP8-quantized checkpoints (loader/quantized.py): compressed-tensors, GPTQ, AWQ.

compressed-tensors: the checkpoints are written by the compressed-tensors library itself
(``apply_quantization_config``, min-max scales from its ``calculate_qparams``, its
``ModelCompressor``), and the oracles are its own quantize-dequantize (``fake_quantize``: the
values the stored codes stand for) and transformers, which loads a W4A16 folder through its
compressed-tensors integration. GPTQ and AWQ: transformers reads them only through gptqmodel
(a CUDA build), so the folders are written here by the formats' definitions (AutoGPTQ's and
AutoAWQ's packers, restated below as loops over the codes), and the oracle is the float model
whose weights are ``(q - zero) * scale`` of the same codes, run by transformers.
"""
from __future__ import annotations

import json

import pytest
import torch

from blitzllm import LLM, SamplingParams

CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
PROMPTS = [[1, 5, 9, 17, 33, 65], [2, 200, 13]]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _llama(seed=0):
    import transformers
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).float().eval()


def _greedy_hf(model, n=6) -> list:
    out = []
    for ids in PROMPTS:
        x = torch.tensor([ids])
        with torch.no_grad():
            g = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
        out.append(g[0, len(ids):].tolist())
    return out


def _greedy_ours(folder, n=6) -> tuple:
    llm = LLM(str(folder), dtype="float32", kv_cache_blocks=32)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=n))
        weights = {k: v.detach().clone() for k, v in llm.engine.runner.model.named_parameters()}
        return [o.outputs[0].token_ids for o in outs], weights
    finally:
        llm.engine.close()


# ---- compressed-tensors ---------------------------------------------------------------------

def _ct_quantize(model, weights: dict, fmt: str):
    """``model``'s linear layers (not lm_head) quantized by compressed-tensors with ``weights``
    (QuantizationArgs fields), min-max scales; returns the fake-quantized weights by module name."""
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config, fake_quantize)
    from compressed_tensors.quantization.utils import calculate_qparams
    args = QuantizationArgs(**weights)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"],
        format=fmt))
    want = {}
    for name, mod in model.named_modules():
        if not hasattr(mod, "weight_scale"):
            continue
        w = mod.weight.data
        out, cols = w.shape
        if args.strategy == "group":
            g = w.view(out, cols // args.group_size, args.group_size)
            mn, mx = g.amin(-1), g.amax(-1)
        elif args.strategy == "channel":
            mn, mx = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        elif args.strategy == "block":
            bh, bw = args.block_structure
            b = w.view(out // bh, bh, cols // bw, bw)
            mn, mx = b.amin((1, 3)), b.amax((1, 3))
        else:
            mn, mx = w.amin().reshape(1), w.amax().reshape(1)
        scale, zero = calculate_qparams(mn.clamp(max=0), mx.clamp(min=0), args)
        mod.weight_scale.data = scale.to(mod.weight_scale.dtype)
        if hasattr(mod, "weight_zero_point"):
            mod.weight_zero_point.data = zero.to(mod.weight_zero_point.dtype)
        want[name] = fake_quantize(w, mod.weight_scale, getattr(mod, "weight_zero_point", None), args)
    return want


def _ct_folder(path, weights: dict, fmt: str, dtype=torch.float32) -> dict:
    from compressed_tensors.compressors import ModelCompressor
    model = _llama().to(dtype)
    want = _ct_quantize(model, weights, fmt)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(str(path))
    compressor.update_config(str(path))
    return want


def test_compressed_tensors_w4a16_matches_transformers(tmp_path):
    """A W4A16 checkpoint (int4, symmetric, groups of 32, pack-quantized): the loaded weights are
    compressed-tensors' dequantized values and the greedy tokens transformers' on the folder."""
    import transformers
    want = _ct_folder(tmp_path, dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
                      "pack-quantized")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens, weights = _greedy_ours(tmp_path)
    assert tokens == _greedy_hf(hf)
    for name, w in want.items():
        assert torch.equal(weights[name + ".weight"] if name + ".weight" in weights else _packed(weights, name), w)


def _packed(weights: dict, name: str) -> torch.Tensor:
    """A module's rows inside our packed projection (q/k/v as qkv_proj, gate/up as gate_up_proj)."""
    layer, proj = name.rsplit(".", 1)
    blocks = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    packed, k = blocks[proj]
    whole = weights[f"{layer}.{packed}.weight"]
    heads, kv = CFG["num_attention_heads"], CFG["num_key_value_heads"]
    d = CFG["hidden_size"] // heads
    sizes = [heads * d, kv * d, kv * d] if packed == "qkv_proj" else [CFG["intermediate_size"]] * 2
    return whole.split(sizes)[k]


@pytest.mark.parametrize("weights, fmt", [
    (dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32), "pack-quantized"),
    (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), "pack-quantized"),
    (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), "int-quantized"),
    (dict(num_bits=8, type="float", symmetric=True, strategy="channel"), "float-quantized"),
    (dict(num_bits=8, type="float", symmetric=True, strategy="tensor"), "float-quantized"),
    (dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[32, 32]), "float-quantized"),
], ids=["int4-group-asym", "int8-channel-packed", "int8-naive", "fp8-channel", "fp8-tensor", "fp8-block"])
def test_compressed_tensors_schemes(tmp_path, weights, fmt):
    """Other schemes and formats: every loaded weight is exactly compressed-tensors' quantize-dequantize
    of the original (the values its stored codes stand for), and the greedy tokens are those of
    transformers' model holding those weights."""
    want = _ct_folder(tmp_path, weights, fmt)
    tokens, ours = _greedy_ours(tmp_path)
    ref = _llama()
    with torch.no_grad():
        for name, w in want.items():
            ref.get_submodule(name).weight.copy_(w)
            got = ours[name + ".weight"] if name + ".weight" in ours else _packed(ours, name)
            assert torch.equal(got, w), name
    assert tokens == _greedy_hf(ref)


# ---- GPTQ and AWQ, by their definitions -----------------------------------------------------

def _minmax_codes(w: torch.Tensor, group: int, bits: int, g_idx=None, sym: bool = False) -> tuple:
    """Min-max codes of w [out, in] (``sym``: zero 2 ** (bits - 1), GPTQ's sym): (q [out, in], scale
    [groups, out] fp16, zero [groups, out])."""
    out, cols = w.shape
    g_idx = torch.arange(cols) // group if g_idx is None else g_idx
    groups = int(g_idx.max()) + 1
    scale = torch.empty(groups, out, dtype=torch.float16)
    zero = torch.empty(groups, out, dtype=torch.int32)
    top = (1 << bits) - 1
    for g in range(groups):
        cols_g = w[:, g_idx == g]
        mn, mx = cols_g.amin(1).clamp(max=0), cols_g.amax(1).clamp(min=0)
        if sym:
            scale[g] = (torch.maximum(-mn, mx) / (top // 2)).clamp(min=1e-6).half()
            zero[g] = (top + 1) // 2
        else:
            scale[g] = ((mx - mn) / top).clamp(min=1e-6).half()
            zero[g] = torch.round(-mn / scale[g].float()).clamp(0, top).int()
    q = torch.round(w / scale.float().T[:, g_idx] + zero.T[:, g_idx]).clamp(0, top).int()
    return q, scale, zero


def _pack_cols(values: torch.Tensor, bits: int, slots=None) -> torch.Tensor:
    """Codes [rows, cols] into int32 words along the columns: word c of a row holds columns
    c * per .. c * per + per - 1, column c * per + i in slot i (or column c * per + slots[i] in slot i)."""
    per = 32 // bits
    rows, cols = values.shape
    out = torch.zeros(rows, cols // per, dtype=torch.int64)
    for c in range(cols // per):
        for i in range(per):
            j = c * per + (slots[i] if slots else i)
            out[:, c] |= values[:, j].long() << (bits * i)
    return torch.where(out >= 1 << 31, out - (1 << 32), out).int()   # (the words' bits as int32)


def _write(path, tensors: dict, qc: dict) -> None:
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                  "torch_dtype": "float32", **CFG, "quantization_config": qc}))


def _quantized_folder(path, kind: str, desc_act: bool = False, sym: bool = False) -> object:
    """The folder of ``kind`` (gptq / awq) for _llama()'s linear layers (groups of 32, 4-bit), and the
    float model whose weights are the codes' (q - zero) * scale."""
    model, bits, group = _llama(), 4, 32
    tensors = {k: v for k, v in model.state_dict().items() if not any(p in k for p in LINEARS)}
    gen = torch.Generator().manual_seed(1)
    for name, mod in model.named_modules():
        if name.split(".")[-1] not in LINEARS:
            continue
        w = mod.weight.data
        cols = w.shape[1]
        g_idx = (torch.randperm(cols, generator=gen) // group) if desc_act else None
        q, scale, zero = _minmax_codes(w, group, bits, g_idx, sym)
        gi = torch.arange(cols) // group if g_idx is None else g_idx
        with torch.no_grad():   # the float weights the codes stand for, in fp16 as the kernels compute them
            mod.weight.copy_(((q - zero.T[:, gi]).half() * scale.T[:, gi]).float())
        if kind == "gptq":   # qweight packed along the input dimension; zeros stored minus one
            tensors[f"{name}.qweight"] = _pack_rows(q.T, bits)
            tensors[f"{name}.qzeros"] = _pack_cols(zero - 1, bits)
            tensors[f"{name}.g_idx"] = gi.int()
        else:                # AWQ GEMM: [in, out] with AutoAWQ's column order in each word
            tensors[f"{name}.qweight"] = _pack_cols(q.T.contiguous(), bits, slots=(0, 2, 4, 6, 1, 3, 5, 7))
            tensors[f"{name}.qzeros"] = _pack_cols(zero, bits, slots=(0, 2, 4, 6, 1, 3, 5, 7))
        tensors[f"{name}.scales"] = scale
    qc = ({"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
           "checkpoint_format": "gptq"} if kind == "gptq" else
          {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"})
    _write(path, tensors, qc)
    return model


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [rows, cols] into int32 words along the rows (GPTQ's qweight): word r of a column holds
    rows r * per + i in slot i."""
    return _pack_cols(values.T.contiguous(), bits).T.contiguous()


@pytest.mark.parametrize("kind, desc_act", [("gptq", False), ("gptq", True), ("awq", False)])
def test_gptq_and_awq(tmp_path, kind, desc_act):
    """GPTQ (groups in order, and in activation order through g_idx) and AWQ folders: every
    loaded weight is (q - zero) * scale of its codes, and the greedy tokens are transformers' on
    the float model of those weights."""
    ref = _quantized_folder(tmp_path, kind, desc_act)
    tokens, ours = _greedy_ours(tmp_path)
    for name, mod in ref.named_modules():
        if name.split(".")[-1] in LINEARS:
            got = ours[name + ".weight"] if name + ".weight" in ours else _packed(ours, name)
            assert torch.equal(got, mod.weight), name
    assert tokens == _greedy_hf(ref)


@pytest.mark.parametrize("kind", ["gptq-sym", "gptq-act-order", "awq", "ct-w4a16", "ct-w8a16", "ct-fp8"])
def test_cpu_keeps_the_codes(tmp_path, kind):
    """On the CPU with no dtype asked, 4-bit codes in column-order groups and symmetric 8-bit codes
    stay codes (the GGUF blocks of kernels/cpu_quant: Q4_1 with m = -zero * scale, exact for
    symmetric codes; Q8_0) and run on its kernels; activation-order groups and FP8 are
    dequantized. The same greedy tokens as the dequantized weights, logprobs within 1e-3 (1e-2
    where zero points round m to fp16)."""
    if kind.startswith("ct"):
        weights = {"ct-w4a16": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
                   "ct-w8a16": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                   "ct-fp8": dict(num_bits=8, type="float", symmetric=True, strategy="channel")}[kind]
        _ct_folder(tmp_path, weights, "float-quantized" if kind == "ct-fp8" else "pack-quantized")
    else:
        _quantized_folder(tmp_path, kind[:4], desc_act=kind == "gptq-act-order", sym=kind == "gptq-sym")
    p = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    with LLM(str(tmp_path), kv_cache_blocks=32) as codes, LLM(str(tmp_path), dtype="float32", kv_cache_blocks=32) as ref:
        kept = [m for m in codes.engine.runner.model.modules() if getattr(m, "quant", None) is not None]
        assert len(kept) == (0 if kind in ("gptq-act-order", "ct-fp8") else 4 * CFG["num_hidden_layers"])
        assert {m.quant.kind for m in kept} <= {"q8" if kind == "ct-w8a16" else "q4"}
        for a, b in zip(codes.generate(prompts, p), ref.generate(prompts, p)):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            lps = [torch.tensor([lp[t] for lp, t in zip(o.logprobs, o.token_ids)]) for o in (a.outputs[0], b.outputs[0])]
            tol = 1e-2 if kind == "awq" else 1e-3
            torch.testing.assert_close(lps[0], lps[1], atol=tol, rtol=0)


def test_refusals(tmp_path):
    """Quantizations this loader does not read, and a quantized module missing a part, are ValueErrors."""
    from blitzllm.loader.quantized import quantized_stream
    for qc, msg in (({"quant_method": "awq", "bits": 4, "version": "gemv"}, "GEMM layout"),
                    ({"quant_method": "gptq", "bits": 3}, "3-bit"),
                    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format"),
                    ({"quant_method": "compressed-tensors", "format": "sparse-24-bitmask", "config_groups": {}},
                     "sparse-24"),
                    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {},
                      "sparsity_config": {"format": "sparse-bitmask"}}, "sparsity")):
        with pytest.raises(ValueError, match=msg):
            quantized_stream({"quantization_config": qc})
    stream = quantized_stream({"quantization_config": {"quant_method": "gptq", "bits": 4}})
    with pytest.raises(ValueError, match="has no qzeros, scales"):
        list(stream([("a.qweight", torch.zeros(1, 8, dtype=torch.int32))]))
    ref = _quantized_folder(tmp_path, "awq")
    del ref
    # vLLM's quantization argument names the checkpoint's method (awq_marlin: the same checkpoints)
    LLM(str(tmp_path), dtype="float32", kv_cache_blocks=8, quantization="awq_marlin").engine.close()
    with pytest.raises(ValueError, match="'gptq' asked, but the checkpoint's quantization_config has quant_method 'awq'"):
        LLM(str(tmp_path), dtype="float32", kv_cache_blocks=8, quantization="gptq")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(tmp_path), dtype="float32", kv_cache_blocks=8, quantization="bitsandbytes")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported"):
        LLM(str(tmp_path), dtype="float32", kv_cache_blocks=8)


def awq_in_place(path, group: int = 32) -> dict:
    """Rewrite the folder's linear weights (attention, MLP and every expert; not routers, norms,
    embeddings, lm_head) as AWQ GEMM codes; returns the float weights the codes stand for."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(path / "model.safetensors"))
    floats = {}
    for name in [k for k in tensors if k.endswith(".weight") and k.split(".")[-2] in LINEARS]:
        module, w = name[:-len(".weight")], tensors.pop(name)
        q, scale, zero = _minmax_codes(w, group, 4)
        gi = torch.arange(w.shape[1]) // group
        floats[name] = ((q - zero.T[:, gi]).half() * scale.T[:, gi]).float()
        tensors[f"{module}.qweight"] = _pack_cols(q.T.contiguous(), 4, slots=(0, 2, 4, 6, 1, 3, 5, 7))
        tensors[f"{module}.qzeros"] = _pack_cols(zero, 4, slots=(0, 2, 4, 6, 1, 3, 5, 7))
        tensors[f"{module}.scales"] = scale
    save_file(tensors, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                  "version": "gemm"}
    (path / "config.json").write_text(json.dumps(cfg))
    return floats


def test_awq_moe_matches_transformers(tmp_path):
    """Qwen3-MoE with every expert in AWQ codes: transformers' greedy tokens and logprobs on the
    float model of those codes (the stacked experts are built from the dequantized ones)."""
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file
    from tests.models.test_moe_models import check_matches_transformers, make_moe_checkpoint
    make_moe_checkpoint("qwen3_moe", tmp_path / "q", seed=1, mlp_only_layers=[2])
    shutil.copytree(tmp_path / "q", tmp_path / "float")
    floats = awq_in_place(tmp_path / "q")
    assert any(".experts." in k for k in floats)
    # (transformers holds the experts fused: the float folder goes through its loading conversion)
    save_file({**load_file(str(tmp_path / "float" / "model.safetensors")), **floats},
              str(tmp_path / "float" / "model.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "float"), dtype=torch.float32).eval()
    check_matches_transformers(hf, tmp_path / "q").engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gptq", "awq"])
def test_quantized_checkpoint_on_cuda(tmp_path, kind):
    """On CUDA (fp32, decode graphs captured) the dequantized weights give the CPU engine's greedy
    tokens, which equal transformers' (test_gptq_and_awq), and every block comes back."""
    _quantized_folder(tmp_path, kind)
    want, _ = _greedy_ours(tmp_path)
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_blocks=32)
    try:
        assert llm.engine.runner.graphs is not None
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=6))
        assert [o.outputs[0].token_ids for o in outs] == want and llm.stats()["kv_blocks_free"] == 32
    finally:
        llm.engine.close()
