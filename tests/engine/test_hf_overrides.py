"""vLLM's command-line compatibility: ``hf_overrides`` (config.json keys set over the model's,
loader/source.py), ``--quantization fp8`` (= ``--weight-dtype fp8``) and ``--trust-remote-code``
(accepted; blitzllm runs no checkpoint code)."""
import json

import pytest
import torch

from blitzllm import LLM, SamplingParams
from blitzllm.cli import main
from blitzllm.loader.source import apply_hf_overrides


def test_an_override_reaches_the_model(tiny_llama):
    """An overridden rms_norm_eps (as a dict and as JSON text) gives transformers' logprobs on the same
    weights loaded with that eps, and not those of the checkpoint's own eps; an overridden
    max_position_embeddings bounds the context."""
    import transformers
    path, hf = tiny_llama
    prompt = [5, 17, 99, 3, 250, 8, 41]
    p = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    hf_eps = transformers.AutoModelForCausalLM.from_pretrained(str(path), rms_norm_eps=0.5, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf_eps(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
        plain = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    for overrides in ({"rms_norm_eps": 0.5, "max_position_embeddings": 128}, json.dumps({"rms_norm_eps": 0.5})):
        llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_blocks=16, hf_overrides=overrides)
        out = llm.generate([{"prompt_token_ids": prompt}], p)[0].outputs[0]
        got = out.logprobs[0]
        assert out.token_ids[0] == int(want.argmax())
        for t, lp in got.items():
            assert abs(lp - float(want[t])) < 1e-4 and abs(lp - float(plain[t])) > 1e-3
        if isinstance(overrides, dict):
            assert llm.engine.model_config.max_position_embeddings == 128 and llm.engine.max_model_len == 128


def test_sub_configs_merge_key_by_key():
    cfg = {"architectures": ["X"], "text_config": {"a": 1, "b": 2}, "rope_scaling": {"type": "yarn", "factor": 4}}
    out = apply_hf_overrides(cfg, {"text_config": {"b": 3}, "rope_scaling": {"factor": 8}, "new": 1})
    assert out == {"architectures": ["X"], "text_config": {"a": 1, "b": 3}, "rope_scaling": {"factor": 8}, "new": 1}
    assert cfg["text_config"] == {"a": 1, "b": 2}   # (the source's dict untouched)


@pytest.mark.parametrize("value,match", [("{bad", "hf_overrides must be a JSON object: Expecting"),
                                         ("[1]", "must be a JSON object"), (3, "must be a JSON object")])
def test_bad_overrides(tiny_llama, value, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_llama[0]), device="cpu", hf_overrides=value)


def _cli(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().err.strip().splitlines()


def test_cli_flags(capsys):
    """--hf-overrides and --trust-remote-code run (the override applied: a context of 16 refuses a
    longer prompt); --quantization fp8 is --weight-dtype fp8; their errors are one line, exit 2."""
    base = ["generate", "--model", "preset:qwen3-0.6b", "--num-layers", "1", "--device", "cpu", "--max-tokens", "2",
            "--no-chat", "--prompt"]
    short, long = "hi", " ".join(["word"] * 40)
    code, err = _cli(capsys, *base, short, "--trust-remote-code", "--hf-overrides", '{"max_position_embeddings": 16}')
    assert code == 0, err
    code, err = _cli(capsys, *base, long, "--hf-overrides", '{"max_position_embeddings": 16}')
    assert code == 2 and len(err) == 1 and "max_model_len" in err[0], err
    code, err = _cli(capsys, *base, short, "--hf-overrides", "{bad")
    assert code == 2 and len(err) == 1 and "hf_overrides" in err[0]
    code, err = _cli(capsys, *base, short, "-q", "fp8", "--weight-dtype", "int4")
    assert code == 2 and len(err) == 1 and "--quantization" in err[0]
    from blitzllm.cli_args import add_engine_args, engine_kwargs
    import argparse
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    assert engine_kwargs(ap.parse_args(["-q", "fp8"]))["weight_dtype"] == "fp8"
    assert engine_kwargs(ap.parse_args(["--quantization", "fp8", "--weight-dtype", "fp8"]))["weight_dtype"] == "fp8"
    # a checkpoint method: checked against the checkpoint (a preset has none)
    assert engine_kwargs(ap.parse_args(["-q", "awq"]))["quantization"] == "awq"
    code, err = _cli(capsys, *base, short, "-q", "gptq")
    assert code == 2 and len(err) == 1 and "quant_method None" in err[0], err
