"""vLLM's serve options that shape answers, on one tiny server: several ``--served-model-name``s
(/v1/models lists each, a request may name any, the answer names the first; the --model path is
still accepted; another name is a 404; bad names are one error line before the model loads), and
``--enable-prompt-tokens-details`` (usage's ``prompt_tokens_details.cached_tokens``: the prompt
tokens the prefix cache served, as /metrics counts them, whole and streamed), and vLLM's
``cache_salt`` request field (prefixes shared only between requests of one salt), and
``--enable-prompt-embeds`` (completions' ``prompt_embeds``: base64 of torch.save'd tensors)."""
from __future__ import annotations

import json

import httpx
import pytest

from blitzllm.cli import main
from tests.server.conftest import ServerProcess, _tiny_llama, running
from tests.server.server_helpers import check_error, wait_idle


@pytest.fixture(scope="module")
def named(tmp_path_factory):
    folder = _tiny_llama(tmp_path_factory.mktemp("tiny-llama-names"))
    srv = ServerProcess(["--model", str(folder), "--served-model-name", "tiny", "tiny-v2", "team/tiny",
                         "--enable-prompt-tokens-details", "--enable-prompt-embeds", "--max-model-len", "512",
                         "--kv-cache-blocks", "64"],
                        tmp_path_factory.mktemp("tiny-names") / "server.log")
    for s in running(srv):
        yield s, folder


def test_every_name_is_listed_and_served(named):
    srv, folder = named
    ids = [c["id"] for c in httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]]
    assert ids == ["tiny", "tiny-v2", "team/tiny"]
    assert httpx.get(srv.url + "/v1/models/team/tiny", timeout=10).json()["id"] == "team/tiny"
    for name in ("tiny", "tiny-v2", "team/tiny", str(folder)):
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"model": name, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == "tiny"
    check_error(httpx.post(srv.url + "/v1/completions", timeout=60, json={"model": "other", "prompt": "Hi"}),
                404, "model")
    wait_idle(srv)


@pytest.mark.parametrize("names", [["a", "a"], ["a", " "]])
def test_bad_names_are_one_line(capsys, names):
    assert main(["serve", "--model", "smollm2", "--served-model-name", *names]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "blitz: error: --served-model-name takes distinct, non-empty names", err


def _streamed_usage(url: str, path: str, body: dict) -> dict:
    with httpx.stream("POST", url + path, timeout=60, json={**body, "stream": True,
                                                           "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    return chunks[-1]["usage"]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "A long question about the weather " * 8}]}),
    ("/v1/completions", {"prompt": ["A long prompt about the sea and its tides " * 6, "Hi"]}),
])
def test_prompt_tokens_details_count_the_prefix_cache(named, path, body):
    srv, _ = named
    body = {"model": "tiny-v2", "max_tokens": 3, "temperature": 0, **body}
    first = httpx.post(srv.url + path, json=body, timeout=60).json()["usage"]
    hits = srv.metrics()["blitz_prefix_cache_hit_tokens_total"]
    again = httpx.post(srv.url + path, json=body, timeout=60).json()["usage"]
    served = srv.metrics()["blitz_prefix_cache_hit_tokens_total"] - hits
    assert served >= 16 and again["prompt_tokens_details"] == {"cached_tokens": served}
    assert again["prompt_tokens"] == first["prompt_tokens"] and set(first["prompt_tokens_details"]) == {"cached_tokens"}
    hits = srv.metrics()["blitz_prefix_cache_hit_tokens_total"]
    streamed = _streamed_usage(srv.url, path, body)
    assert streamed["prompt_tokens_details"] == {"cached_tokens": srv.metrics()["blitz_prefix_cache_hit_tokens_total"]
                                                 - hits}
    wait_idle(srv)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Salted question about the moon " * 8}]}),
    ("/v1/completions", {"prompt": "A salted prompt about rivers and their deltas " * 6}),
    ("/v1/responses", {"input": "Salted input about mountains and valleys " * 6, "max_output_tokens": 3}),
])
def test_cache_salt_keeps_tenants_apart(named, path, body):
    """Two tenants send the same prompt: neither is served the other's (or the unsalted) blocks,
    a repeat under one salt is, and the answers are the same tokens; an empty salt is a 400."""
    srv, _ = named
    body = {"model": "tiny", "temperature": 0, **({} if "max_output_tokens" in body else {"max_tokens": 3}), **body}
    answers = []
    # (the unsalted request may find earlier tests' blocks: the chat template's opening is common)
    a, b = f"tenant-a{path}", f"tenant-b{path}"   # (fresh salts: the other cases' prompts open alike too)
    for salt, cached in ((None, None), (a, False), (b, False), (a, True)):
        hits = srv.metrics()["blitz_prefix_cache_hit_tokens_total"]
        r = httpx.post(srv.url + path, json={**body, **({"cache_salt": salt} if salt else {})}, timeout=60)
        assert r.status_code == 200, r.text
        served = srv.metrics()["blitz_prefix_cache_hit_tokens_total"] - hits
        if cached is not None:
            assert (served >= 16) if cached else served == 0, (salt, served)
        out = r.json()
        answers.append(out["output"][-1]["content"][0]["text"] if "output" in out
                       else out["choices"][0].get("text") or out["choices"][0]["message"]["content"])
    assert len(set(answers)) == 1 and answers[0], answers
    check_error(httpx.post(srv.url + path, json={**body, "cache_salt": ""}, timeout=60), 400, "cache_salt")
    wait_idle(srv)


def _b64_tensor(t) -> str:
    import base64
    import io

    import torch
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


def test_prompt_embeds_complete_as_their_tokens(named):
    """A prompt's own token embeddings, sent as prompt_embeds (one, and a list beside another),
    complete as its token ids do; what cannot be served is a 400 naming the field."""
    import torch
    from safetensors.torch import load_file
    srv, folder = named
    table = load_file(str(folder / "model.safetensors"))["model.embed_tokens.weight"]
    ids = [5, 9, 40, 77, 120, 3, 18]
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "logprobs": 1}
    want = httpx.post(srv.url + "/v1/completions", json={**body, "prompt": ids}, timeout=60).json()
    got = httpx.post(srv.url + "/v1/completions", json={**body, "prompt_embeds": _b64_tensor(table[ids])},
                     timeout=60).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["choices"][0]["logprobs"]["tokens"] == want["choices"][0]["logprobs"]["tokens"]
    assert got["usage"]["prompt_tokens"] == len(ids)
    two = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        **body, "prompt_embeds": [_b64_tensor(table[ids][None]), _b64_tensor(table[ids[:3]])]}).json()
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["choices"][0]["text"] == want["choices"][0]["text"] and two["usage"]["prompt_tokens"] == len(ids) + 3
    for bad, field in [({"prompt_embeds": "not base64!"}, "prompt_embeds"),
                       ({"prompt_embeds": _b64_tensor({"a": 1})}, "prompt_embeds"),
                       ({"prompt_embeds": _b64_tensor(torch.zeros(3, 5))}, "prompt_embeds"),
                       ({"prompt_embeds": _b64_tensor(table[ids]), "prompt": "Hi"}, "prompt_embeds"),
                       ({"prompt_embeds": _b64_tensor(table[ids]), "echo": True}, "echo"),
                       ({}, "prompt")]:
        check_error(httpx.post(srv.url + "/v1/completions", json={**body, **bad}, timeout=60), 400, field)
    wait_idle(srv)
