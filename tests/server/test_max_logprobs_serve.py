"""blitz serve --max-logprobs (vLLM's): completions' logprobs, chat's top_logprobs, responses'
top_logprobs and prompt_logprobs up to the flag's value are answered with that many
alternatives; past it a request is a 400 naming its field, and the server keeps serving."""
from __future__ import annotations

import httpx
import pytest

from conftest import ServerProcess, _tiny_llama, running
from server_helpers import check_error

CAP = 25


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    folder = _tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    yield from running(ServerProcess(["--model", str(folder), "--max-model-len", "512", "--kv-cache-blocks", "64",
                                      "--max-logprobs", str(CAP)], tmp_path_factory.mktemp("cap") / "server.log"))


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json={"max_tokens": 2, "temperature": 0, **body}, timeout=60)


def test_up_to_the_cap(srv):
    # (as token ids: the legacy format keys a token's alternatives by their text, which repeats)
    r = _post(srv, "/v1/completions", {"prompt": "The sea is", "logprobs": CAP, "prompt_logprobs": CAP,
                                       "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert all(len(top) >= CAP for top in choice["logprobs"]["top_logprobs"])
    assert all(len(p) >= CAP for p in choice["prompt_logprobs"][1:])
    r = _post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                                            "top_logprobs": CAP})
    assert r.status_code == 200, r.text
    assert all(len(t["top_logprobs"]) == CAP for t in r.json()["choices"][0]["logprobs"]["content"])
    r = _post(srv, "/v1/responses", {"input": "Hi", "max_output_tokens": 2, "top_logprobs": CAP,
                                     "include": ["message.output_text.logprobs"]})
    assert r.status_code == 200, r.text
    text = [c for o in r.json()["output"] if o["type"] == "message" for c in o["content"]][0]
    assert all(len(t["top_logprobs"]) == CAP for t in text["logprobs"])


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "Hi", "logprobs": CAP + 1}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": CAP + 1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "echo": True, "logprobs": CAP + 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                              "top_logprobs": CAP + 1}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": CAP + 1},
     "prompt_logprobs"),
    ("/v1/responses", {"input": "Hi", "top_logprobs": CAP + 1}, "top_logprobs"),
])
def test_past_the_cap_is_a_400(srv, path, body, param):
    err = check_error(_post(srv, path, body), 400, param)
    assert f"at most {CAP}" in err["message"] and "--max-logprobs" in err["message"]
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    assert httpx.get(srv.url + "/metrics", timeout=10).status_code == 200
