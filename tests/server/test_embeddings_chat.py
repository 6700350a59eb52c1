"""vLLM's chat form of POST /v1/embeddings on a real ``blitz serve`` (SmolLM2, fp32 on the CPU):
a ``messages`` body is one vector, the offline engine's ``LLM.embed`` of the token ids that
transformers' own ``apply_chat_template`` gives for those messages (1e-4), with usage; the
flags that change the rendering; the 400s (both or neither of input and messages, a bad
message, a request chat template, a priority under fcfs) as OpenAI-style errors, after which
the server still serves and holds no KV block; and the router forwarding the body whole."""
from __future__ import annotations

import httpx
import pytest

from tests.server.server_helpers import check_error, rejected, wait_idle

MODEL = "smollm2"
TOL = 1e-4
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."}]


@pytest.fixture(scope="module")
def offline(smollm2_llm):
    import torch
    if torch.cuda.is_available():
        pytest.skip("the server runs bf16 on CUDA; this compares with the CPU's fp32 engine")
    return smollm2_llm


def hf_ids(offline, messages, **kw) -> list:
    """The chat template's token ids as transformers renders and tokenizes them."""
    return list(offline.tokenizer.apply_chat_template(messages, tokenize=True, **kw)["input_ids"])


def close(a, b) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < TOL


def post(srv, body: dict) -> httpx.Response:
    return httpx.post(srv.url + "/v1/embeddings", json=body, headers=srv.headers(), timeout=120)


def vector(r: httpx.Response) -> list:
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == MODEL and len(body["data"]) == 1
    assert body["data"][0]["index"] == 0 and body["data"][0]["object"] == "embedding"
    return body["data"][0]["embedding"]


def test_messages_are_embedded_as_the_chat_template_renders_them(smol_f32_server, offline):
    srv = smol_f32_server
    ids = hf_ids(offline, CHAT, add_generation_prompt=False)
    opened = hf_ids(offline, CHAT, add_generation_prompt=True)
    assert opened != ids and opened[:len(ids)] == ids   # (the oracle's two renderings differ)
    want, want_opened = (o.outputs.embedding for o in offline.embed([ids, opened]))
    r = post(srv, {"model": MODEL, "messages": CHAT})
    assert close(vector(r), want)
    assert r.json()["usage"] == {"prompt_tokens": len(ids), "total_tokens": len(ids)}
    r = post(srv, {"messages": CHAT, "add_generation_prompt": True, "priority": 0})
    assert close(vector(r), want_opened) and not close(vector(r), want)
    assert r.json()["usage"]["prompt_tokens"] == len(opened)
    # null is the default (no assistant turn opened), as every field's null is
    assert close(vector(post(srv, {"messages": CHAT, "add_generation_prompt": None})), want)
    assert wait_idle(srv)["blitz_kv_cache_usage_perc"] == 0


def test_the_chat_form_fields(smol_f32_server, offline):
    from blitzllm import PoolingParams
    srv = smol_f32_server
    # continue_final_message: the assistant's message left open
    cont = hf_ids(offline, CHAT, add_generation_prompt=False, continue_final_message=True)
    r = post(srv, {"messages": CHAT, "continue_final_message": True, "normalize": False,
                   "truncate_prompt_tokens": 9, "encoding_format": "float"})
    want = offline.embed([cont[-9:]], PoolingParams(normalize=False))[0].outputs.embedding
    assert close(vector(r), want) and r.json()["usage"]["prompt_tokens"] == 9
    # add_special_tokens: the tokenizer's own on top of the rendered text (SmolLM2 adds none)
    text = offline.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    r = post(srv, {"messages": CHAT, "add_special_tokens": True})
    assert r.json()["usage"]["prompt_tokens"] == len(offline.tokenizer(text, add_special_tokens=True)["input_ids"])
    # chat_template_kwargs reach the template (a variable it does not read changes nothing)
    plain = vector(post(srv, {"messages": CHAT}))
    assert close(vector(post(srv, {"messages": CHAT, "chat_template_kwargs": {"unused": 1}})), plain)
    assert wait_idle(srv)["blitz_kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("body, param", [
    ({"input": "Hi", "messages": CHAT}, "messages"),
    ({}, "input"),
    ({"input": None, "messages": None}, "input"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "Hi"}]}, "messages.0.role"),
    ({"messages": [{"content": "Hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
    ({"messages": "Hi"}, "messages"),
    ({"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    ({"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": True}}, "chat_template_kwargs"),
    ({"messages": CHAT, "dimensions": 8}, "dimensions"),
    ({"messages": CHAT, "truncate_prompt_tokens": 5000}, "truncate_prompt_tokens"),
    ({"messages": CHAT, "priority": "high"}, "priority"),
    ({"messages": CHAT, "priority": 3}, "priority"),
    ({"input": "Hi", "priority": -2}, "priority"),
    ({"messages": [{"role": "user", "content": "word " * 1100}]}, "messages"),
])
def test_errors(smol_f32_server, body, param):
    srv = smol_f32_server
    before = rejected(srv)
    err = check_error(post(srv, {"model": MODEL, **body}), 400, param)
    if isinstance(body.get("priority"), int):   # (under the default fcfs policy, as chat's)
        assert "--scheduling-policy priority" in err["message"]
    assert rejected(srv) == before + 1
    m = wait_idle(srv)
    assert m["blitz_num_requests_running"] == 0 and m["blitz_kv_cache_usage_perc"] == 0
    assert len(vector(post(srv, {"messages": CHAT[:2]}))) == 576   # (still serving)


def test_a_messages_body_through_the_router(smol_f32_server):
    """``blitz router`` relays the body whole: the answer is the backend's own."""
    from fastapi.testclient import TestClient

    from blitzllm.router.app import RouterConfig, build_router_app
    srv = smol_f32_server
    body = {"model": MODEL, "messages": CHAT}
    want = post(srv, body).json()
    with TestClient(build_router_app(RouterConfig(backends=(srv.url,), health_interval_s=0.1))) as router:
        got = router.post("/v1/embeddings", json=body)
        assert got.status_code == 200, got.text
        assert got.json()["usage"] == want["usage"]
        assert close(got.json()["data"][0]["embedding"], want["data"][0]["embedding"])
        check_error(router.post("/v1/embeddings", json={**body, "input": "Hi"}), 400, "messages")
    wait_idle(srv)
