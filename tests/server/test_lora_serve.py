"""LoRA on ``blitz serve`` (vLLM's flags and routes): a request's model naming an adapter gets
the answer ``LLM(..., enable_lora=True)`` gives offline under that adapter (completions, chat,
responses, messages); /v1/models lists the adapters; runtime load / unload; errors."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from blitzllm import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import ALL, ATTN, make_adapter
from tests.server.conftest import ServerProcess, _tiny_llama, running
from tests.server.server_helpers import check_error, wait_idle

N = 8
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    import transformers
    folder = _tiny_llama(tmp_path_factory.mktemp("lora-base"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    root = tmp_path_factory.mktemp("lora-adapters")
    make_adapter(root / "a1", hf, targets=ATTN, r=8, seed=1, std=0.5)
    make_adapter(root / "a2", hf, targets=ALL, r=4, alpha=8, rslora=True, seed=2, std=0.5)
    make_adapter(root / "a3", hf, targets=ALL[4:], r=16, seed=3, std=0.5)
    make_adapter(root / "big", hf, targets=ATTN, r=32, seed=4)
    return folder, root


@pytest.fixture(scope="module")
def lora_server(lora_setup, tmp_path_factory):
    folder, root = lora_setup
    srv = ServerProcess(["--model", str(folder), "--served-model-name", "tiny", "--dtype", "float32",
                         "--max-model-len", "512", "--kv-cache-blocks", "128", "--enable-lora", "--max-loras", "2",
                         "--lora-modules", f"a1={root / 'a1'}", json.dumps({"name": "a2", "path": str(root / "a2")}),
                         "--allow-runtime-lora-updating"],
                        tmp_path_factory.mktemp("lora-srv") / "server.log")
    yield from running(srv)


@pytest.fixture(scope="module")
def offline(lora_setup):
    folder, root = lora_setup
    llm = LLM(str(folder), device="cpu", dtype="float32", max_model_len=512, kv_cache_blocks=128, enable_lora=True,
              max_loras=2)
    loras = {n: LoRARequest(n, i + 1, str(root / n)) for i, n in enumerate(("a1", "a2", "a3"))}
    return llm, loras


GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


def _post(srv, path, body, status=200):
    r = httpx.post(srv.url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r


def _completion(srv, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    out = _post(srv, "/v1/completions", body).json()
    assert out["model"] == model   # (vLLM's: an adapter's answer names the adapter)
    return out["choices"][0]["text"]


def test_completions_and_chat_run_the_named_adapter(lora_server, offline):
    llm, loras = offline
    texts = {m: _completion(lora_server, m) for m in ("tiny", "a1", "a2")}
    assert texts["tiny"] == llm.generate(PROMPT, GREEDY)[0].text
    for m in ("a1", "a2"):
        assert texts[m] == llm.generate(PROMPT, GREEDY, lora_request=loras[m])[0].text
    assert texts["a1"] != texts["tiny"] and texts["a2"] != texts["tiny"]
    want = llm.chat(MESSAGES, GREEDY, lora_request=loras["a2"])[0].text
    body = {"model": "a2", "messages": MESSAGES, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    out = _post(lora_server, "/v1/chat/completions", body).json()
    assert out["choices"][0]["message"]["content"] == want and out["model"] == "a2"
    chunks = []
    with httpx.stream("POST", lora_server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert {c["model"] for c in chunks} == {"a2"}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == want
    assert want != llm.chat(MESSAGES, GREEDY)[0].text
    wait_idle(lora_server)


def test_responses_and_messages_run_the_named_adapter(lora_server, offline):
    llm, loras = offline
    want = llm.chat(MESSAGES, GREEDY, lora_request=loras["a1"])[0].text
    r = _post(lora_server, "/v1/responses", {"model": "a1", "input": MESSAGES[0]["content"], "max_output_tokens": N,
                                             "temperature": 0, "ignore_eos": True}).json()
    assert r["output"][-1]["content"][0]["text"] == want and r["model"] == "a1"
    m = _post(lora_server, "/v1/messages", {"model": "a1", "messages": MESSAGES, "max_tokens": N, "temperature": 0,
                                            "ignore_eos": True}).json()
    assert m["content"][0]["text"] == want and m["model"] == "a1"


def test_models_lists_the_adapters(lora_server, lora_setup):
    root = lora_setup[1]
    data = httpx.get(lora_server.url + "/v1/models", timeout=10).json()["data"]
    by_id = {c["id"]: c for c in data}
    assert {"tiny", "a1", "a2"} <= set(by_id)
    for name in ("a1", "a2"):
        assert by_id[name]["object"] == "model" and by_id[name]["parent"] == "tiny"
        assert by_id[name]["root"] == str(root / name)
    card = httpx.get(lora_server.url + "/v1/models/a1", timeout=10).json()
    assert card == by_id["a1"]
    check_error(httpx.get(lora_server.url + "/v1/models/nope", timeout=10), 404, "model")


def test_beam_search_and_embeddings_under_an_adapter(lora_server, offline):
    """use_beam_search runs the named adapter (beam width 1: its greedy answer); embeddings run on
    the base model only: an adapter's name there is a 400, not the base model's vector in silence."""
    llm, loras = offline
    body = {"model": "a1", "prompt": PROMPT, "max_tokens": N, "ignore_eos": True, "use_beam_search": True, "n": 1}
    out = _post(lora_server, "/v1/completions", body).json()
    assert out["model"] == "a1"
    assert out["choices"][0]["text"] == llm.generate(PROMPT, GREEDY, lora_request=loras["a1"])[0].text
    err = check_error(_post(lora_server, "/v1/embeddings", {"model": "a1", "input": PROMPT}, 400), 400, "model")
    assert "base model" in err["message"]
    assert _post(lora_server, "/v1/embeddings", {"model": "tiny", "input": PROMPT}).json()["data"]
    wait_idle(lora_server)


def test_unknown_model_is_a_404(lora_server):
    body = {"model": "nope", "prompt": PROMPT, "max_tokens": 2}
    assert check_error(_post(lora_server, "/v1/completions", body, 404), 404, "model")["code"] == "model_not_found"


def test_load_and_unload_at_runtime(lora_server, lora_setup, offline):
    root = lora_setup[1]
    llm, loras = offline
    check_error(_post(lora_server, "/v1/completions", {"model": "a3", "prompt": PROMPT}, 404), 404, "model")
    r = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": str(root / "a3")})
    assert "a3" in r.text
    assert _completion(lora_server, "a3") == llm.generate(PROMPT, GREEDY, lora_request=loras["a3"])[0].text
    assert "a3" in {c["id"] for c in httpx.get(lora_server.url + "/v1/models", timeout=10).json()["data"]}
    # the same name again, a bad folder, a rank over --max-lora-rank, the base model's name: 400s
    check_error(_post(lora_server, "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": str(root / "a3")}, 400),
                400, "lora_name")
    err = check_error(_post(lora_server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(root / "no")},
                            400), 400, "lora_path")
    assert "not a local folder" in err["message"]
    err = check_error(_post(lora_server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(root / "big")},
                            400), 400, "lora_path")
    assert "max_lora_rank" in err["message"]
    check_error(_post(lora_server, "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": str(root / "a3")}, 400),
                400, None)
    check_error(_post(lora_server, "/v1/load_lora_adapter", {"lora_name": "x"}, 400), 400, "lora_path")
    _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "a3"})
    check_error(_post(lora_server, "/v1/completions", {"model": "a3", "prompt": PROMPT}, 404), 404, "model")
    check_error(_post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "a3"}, 404), 404, "lora_name")
    # loaded again under the same name, it serves again
    _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": str(root / "a3")})
    assert _completion(lora_server, "a3") == llm.generate(PROMPT, GREEDY, lora_request=loras["a3"])[0].text
    assert wait_idle(lora_server)["blitz_kv_cache_usage_perc"] == 0


def test_unload_while_a_request_runs_lets_it_finish(lora_server, lora_setup, offline):
    root = lora_setup[1]
    _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "busy", "lora_path": str(root / "a1")})
    llm, loras = offline
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True),
                        lora_request=loras["a1"])[0].text
    got, started = {}, threading.Event()

    def run():
        body = {"model": "busy", "prompt": PROMPT, "max_tokens": 120, "temperature": 0, "ignore_eos": True,
                "stream": True}
        text = ""
        with httpx.stream("POST", lora_server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
                    started.set()
        got["text"] = text

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(60)
    _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "busy"})
    t.join(120)
    assert got["text"] == want
    assert wait_idle(lora_server)["blitz_kv_cache_usage_perc"] == 0


def test_runtime_updating_is_off_without_the_flag(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"},
                   headers=tiny_server.headers(), timeout=10)
    assert check_error(r, 404, None)["code"] == "lora_updating_off"


def test_lora_flags_are_checked():
    from blitzllm.server.lora_routes import parse_lora_modules
    assert parse_lora_modules(["a=/p", '{"name": "b", "path": "/q"}']) == (("a", "/p"), ("b", "/q"))
    for bad in (["a"], ["=/p"], ['{"name": "b"}'], ["{nope"], ["a=/p", "a=/q"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(bad)
    import argparse
    from blitzllm.cli_args import add_engine_args
    from blitzllm.server.app import add_serve_args, config_from_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    add_serve_args(p)
    with pytest.raises(ValueError, match="need --enable-lora"):
        config_from_args(p.parse_args(["--lora-modules", "a=/p"]))
    with pytest.raises(ValueError, match="max_loras"):
        config_from_args(p.parse_args(["--enable-lora", "--max-loras", "0"]))
    cfg = config_from_args(p.parse_args(["--enable-lora", "--lora-modules", "a=/p", "--max-lora-rank", "8"]))
    assert cfg.lora_modules == (("a", "/p"),) and cfg.engine_kwargs["max_lora_rank"] == 8


def test_a_bad_startup_adapter_fails_the_start(lora_setup, tmp_path):
    folder, root = lora_setup
    srv = ServerProcess(["--model", str(folder), "--enable-lora", "--kv-cache-blocks", "32",
                         "--lora-modules", f"big={root / 'big'}"], tmp_path / "server.log")
    try:
        assert srv.proc.wait(120) == 2
        assert "max_lora_rank" in srv.log()
    finally:
        srv.stop()
