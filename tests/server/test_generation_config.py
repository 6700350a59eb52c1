"""vLLM's model-default sampling and template options: ``generation_config`` /
``override_generation_config`` (a request's unset fields take the model's generation_config.json
values, in ``LLM`` and in the server) and ``chat_template`` (a file or the template itself, over the
tokenizer's), plus ``--gpu-memory-utilization`` reaching the engine."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from blitzllm import LLM, SamplingParams
from tests.server.conftest import ServerProcess, _tiny_llama, running

# a template of our own, unlike SmolLM2's: [role] content | ... then the assistant's cue
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} | {% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama whose generation_config.json asks for greedy decoding of 6 tokens and a
    repetition penalty (as released checkpoints set temperature / top_p / max_new_tokens)."""
    f = _tiny_llama(tmp_path_factory.mktemp("tiny-genconf"))
    g = json.loads((f / "generation_config.json").read_text())
    g.update(temperature=0.0, top_p=0.8, repetition_penalty=1.3, max_new_tokens=6, do_sample=True)
    (f / "generation_config.json").write_text(json.dumps(g))
    return f


def _llm(folder, **kw):
    return LLM(str(folder), device="cpu", max_model_len=256, kv_cache_blocks=64, **kw)


def test_unset_fields_take_the_models_generation_config(folder):
    llm = _llm(folder)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.repetition_penalty, d.max_tokens) == (0.0, 0.8, 1.3, 6)
    assert (d.top_k, d.min_p) == (0, 0.0)          # keys the file lacks keep SamplingParams' defaults
    prompt = llm.tokenize("The capital of France is")
    got = llm.generate(prompt)[0].outputs[0]
    want = llm.generate(prompt, SamplingParams(temperature=0.0, top_p=0.8, repetition_penalty=1.3,
                                               max_tokens=6))[0].outputs[0]
    assert got.token_ids == want.token_ids and len(got.token_ids) <= 6
    assert "".join(llm.stream(prompt)) == got.text


def test_max_new_tokens_caps_a_request_without_max_tokens(folder):
    llm = _llm(folder, override_generation_config={"max_new_tokens": 5})
    prompt = llm.tokenize("Once upon a time")
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    # the cap yields to the context: a prompt 3 tokens short of max_model_len gets 3, not an error
    long = (prompt * 300)[:253]
    out = llm.generate(long, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3
    explicit = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert len(explicit.token_ids) == 8   # a request's own max_tokens wins


def test_vllm_mode_ignores_the_file_and_overrides_apply_over_it(folder, tmp_path):
    assert _llm(folder, generation_config="vllm").get_default_sampling_params() == SamplingParams()
    d = _llm(folder, override_generation_config='{"temperature": 0.7, "top_k": 20}').get_default_sampling_params()
    assert (d.temperature, d.top_k, d.top_p, d.max_tokens) == (0.7, 20, 0.8, 6)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "min_p": 0.1}))
    d = _llm(folder, generation_config=str(tmp_path)).get_default_sampling_params()
    assert (d.top_p, d.min_p, d.temperature, d.max_tokens) == (0.5, 0.1, 1.0, 16)


@pytest.mark.parametrize("kw, words", [
    ({"override_generation_config": {"temprature": 0.5}}, "override_generation_config must be an object of"),
    ({"override_generation_config": "{not json"}, "not valid JSON"),
    ({"override_generation_config": {"top_p": 0}}, "top_p"),
    ({"generation_config": "/no/such/folder"}, "no such folder"),
    ({"chat_template": "plain words"}, "neither a file nor a Jinja template"),
    ({"chat_template": "{% for m in messages %}{{ m['content'] }"}, "does not render"),
    ({"chat_template": "{{ raise_exception('no') }}"}, "does not render"),
])
def test_bad_options_are_value_errors(folder, kw, words):
    with pytest.raises(ValueError, match=words):
        _llm(folder, **kw)


def test_a_bad_generation_config_file_is_a_value_error(folder, tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": -2}')
    with pytest.raises(ValueError, match="temperature"):
        _llm(folder, generation_config=str(tmp_path))


def test_chat_template_from_a_file_or_inline(folder, tmp_path):
    msgs = [{"role": "user", "content": "Hi there"}]
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    for value in (str(path), TEMPLATE):
        llm = _llm(folder, chat_template=value)
        want = llm.tokenizer("[user] Hi there | [assistant]", add_special_tokens=False).input_ids
        assert llm.apply_chat_template(msgs) == want


def test_server_takes_the_defaults_and_the_template(folder, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    llm = _llm(folder)   # the same model in process: the greedy reference
    srv = ServerProcess(["--model", str(folder), "--max-model-len", "256", "--kv-cache-blocks", "64",
                         "--chat-template", str(path), "--override-generation-config", '{"repetition_penalty": 1.0}',
                         "--gpu-memory-utilization", "0.5"], tmp_path / "server.log")
    for _ in running(srv):
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "The capital of France is"}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        want = llm.generate("The capital of France is", SamplingParams(temperature=0.0, top_p=0.8, max_tokens=6))[0]
        assert body["choices"][0]["text"] == want.outputs[0].text
        assert body["usage"]["completion_tokens"] == len(want.outputs[0].token_ids)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 2,
                                                          "temperature": 0}, timeout=60)
        assert r.json()["usage"]["completion_tokens"] == 2
        r = httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi there"}]}, timeout=60)
        assert r.json()["tokens"] == llm.tokenizer("[user] Hi there | [assistant]", add_special_tokens=False).input_ids


@pytest.mark.parametrize("flag, value, words", [
    ("--override-generation-config", '{"temprature": 1}', "override_generation_config"),
    ("--generation-config", "/no/such/folder", "no such folder"),
    ("--gpu-memory-utilization", "1.5", "gpu_memory_utilization"),
])
def test_serve_refuses_bad_flags_in_one_line(folder, flag, value, words):
    p = subprocess.run([sys.executable, "-m", "blitzllm.cli", "serve", "--model", str(folder), flag, value],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and words in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
