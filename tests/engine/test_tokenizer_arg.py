"""vLLM's ``tokenizer`` engine argument (``--tokenizer``): the tokenizer from another folder or
a .gguf file than the model's own; a bad one is a ValueError (one CLI line) before any loading."""
import pytest

from blitzllm import LLM, SamplingParams
from blitzllm.cli import main
from blitzllm.loader.source import smollm2_path
from blitzllm.loader.tokenizer import load_gguf_tokenizer
from tests.server.conftest import _tiny_llama


def test_a_model_without_tokenizer_files_takes_another(tmp_path):
    """A tiny checkpoint's weights, its tokenizer files (SmolLM2's) moved to another folder:
    without ``tokenizer`` it has none; with it, the same tokens as the folder that holds both."""
    folder = _tiny_llama(tmp_path / "whole")
    whole = LLM(str(folder), device="cpu", dtype="float32", kv_cache_blocks=32)
    bare, tok_dir = tmp_path / "bare", tmp_path / "tok"
    bare.mkdir()
    tok_dir.mkdir()
    for f in folder.iterdir():
        (tok_dir if "token" in f.name or f.name.endswith((".model", ".jinja")) else bare).joinpath(f.name).write_bytes(
            f.read_bytes())
    assert LLM(str(bare), device="cpu", dtype="float32", kv_cache_blocks=32).tokenizer is None
    split = LLM(str(bare), tokenizer=str(tok_dir), device="cpu", dtype="float32", kv_cache_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert split.tokenize("hello world") == whole.tokenize("hello world")
    assert split.generate("hello world", params)[0].token_ids == whole.generate("hello world", params)[0].token_ids


def test_a_gguf_files_tokenizer(tiny_llama):
    """A .gguf file's tokenizer (its metadata's) for a model folder that has none."""
    llm = LLM(str(tiny_llama[0]), tokenizer=str(smollm2_path()), device="cpu", dtype="float32", kv_cache_blocks=32)
    text = "Tokenizers from a GGUF file, 42 times."
    assert llm.tokenize(text) == load_gguf_tokenizer(smollm2_path()).encode(text)


@pytest.mark.parametrize("spec,msg", [("/no/such/folder", "is not a folder, a .gguf file or a hub id"),
                                      ("", "tokenizer must be a folder, a .gguf file or a hub id")])
def test_a_bad_tokenizer_is_one_line(tiny_llama, capsys, spec, msg):
    assert main(["generate", "--prompt", "Hi", "--model", str(tiny_llama[0]), "--tokenizer", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("blitz: error: ") and msg in err, err


def test_a_folder_without_tokenizer_files_is_one_line(tiny_llama, tmp_path, capsys):
    assert main(["generate", "--prompt", "Hi", "--model", str(tiny_llama[0]), "--tokenizer", str(tmp_path)]) == 2
    assert "has no tokenizer.json, tokenizer_config.json or tokenizer.model" in capsys.readouterr().err
