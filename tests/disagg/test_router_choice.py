"""The router's choices without servers: prefix keys, the pick of a backend (longest known
prefix, else fewest in flight, never a down one), the text a conversation's key is made of, and
the command line's errors."""
from __future__ import annotations

import argparse

import pytest

from blitzllm.cli.router import add_router_args, config_from_args
from blitzllm.router.app import prompt_text
from blitzllm.router.backends import Pool, prefix_keys


def test_prefix_keys_are_chained():
    a, b = prefix_keys("x" * 100), prefix_keys("x" * 64 + "y" * 36)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert prefix_keys("z" * 130)[:2] != a[:2]
    from blitzllm.router.backends import PREFIX_MAX_CHUNKS
    assert len(prefix_keys("x" * 64 * (PREFIX_MAX_CHUNKS + 10))) == PREFIX_MAX_CHUNKS  # (hashed on the event loop)


def test_pick_longest_prefix_then_least_outstanding():
    pool = Pool(["http://a", "http://b"], "replica")
    a, b = pool.backends
    assert pool.pick() is None          # nothing is up yet
    a.up = b.up = True
    a.outstanding = 1
    assert pool.pick() is b             # fewest in flight
    system = "system: you are a brief assistant who answers every question in one line\n"
    a.remember(prefix_keys(system + "user: hello"))
    turn2 = prefix_keys(system + "user: hello\nassistant: hi\nuser: and then?")
    assert pool.pick(turn2) is a        # the replica that saw the conversation, though busier
    a.up = False
    assert pool.pick(turn2) is b        # never a down one


def test_prompt_text_keeps_turn_order():
    t1 = prompt_text({"messages": [{"role": "user", "content": "hi"}]})
    t2 = prompt_text({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    assert t2.startswith(t1) and prompt_text({"prompt": "abc"}) == "abc"


@pytest.mark.parametrize("argv, word", [
    (["--prefill", "http://a"], "go together"),
    (["--backend", "http://a", "--prefill", "http://b", "--decode", "http://c"], "not both"),
    ([], "give --prefill"),
    (["--prefill", "http://a", "--decode", "http://b", "--prefix-aware"], "goes with --backend"),
    (["--backend", "a:8000"], "http"),
    (["--backend", "http://"], "HOST"),
    (["--backend", "http://a", "--health-interval", "nan"], "finite"),
    (["--backend", "http://a", "--request-timeout", "inf"], "finite"),
    (["--backend", "http://a", "--max-request-bytes", "10"], ">= 1024"),
])
def test_command_line_errors(argv, word):
    p = argparse.ArgumentParser()
    add_router_args(p)
    with pytest.raises(ValueError, match=word):
        config_from_args(p.parse_args(argv))


@pytest.mark.parametrize("body,code", [
    (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "invalid_json"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "invalid_json"),
    (b'{"prompt": "\xff"}', "invalid_encoding"), (b'{"prompt": ', "invalid_json"),
    (b'{"prompt": "hi", "temperature": NaN}', "invalid_json"), (b'{"prompt": "hi", "top_p": -Infinity}', "invalid_json"),
    (b'{"prompt": "hi", "temperature": 1e400}', "invalid_json"),
    ('{"prompt": "hi"}'.encode("utf-16"), "invalid_encoding"),
], ids=["integer_past_the_digit_limit", "nested_too_deep", "not_utf8", "truncated", "nan", "infinity",
        "overflowing_float", "utf16"])
@pytest.mark.parametrize("mode", ["replicas", "disaggregated"])
def test_router_answers_unreadable_bodies_with_a_400(body, code, mode):
    """Bodies the backends would not read (not UTF-8 JSON, numbers that are not finite) are the
    client's error, a 400 OpenAI error, never a 500, decided before any backend is asked (here none
    answers). (Non-finite numbers gave a 500 in disaggregated mode: httpx would not re-encode them.)"""
    from fastapi.testclient import TestClient

    from blitzllm.router.app import RouterConfig, build_router_app
    cfg = RouterConfig(backends=("http://127.0.0.1:9",)) if mode == "replicas" else \
        RouterConfig(prefill=("http://127.0.0.1:9",), decode=("http://127.0.0.1:9",))
    r = TestClient(build_router_app(cfg), raise_server_exceptions=False).post(
        "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code


def test_router_errors_and_body_limit_are_openai_style():
    """Unknown paths and wrong methods get OpenAI error bodies (FastAPI's {"detail": ...} before);
    a body past --max-request-bytes is a 413."""
    from fastapi.testclient import TestClient

    from blitzllm.router.app import RouterConfig, build_router_app
    client = TestClient(build_router_app(RouterConfig(backends=("http://127.0.0.1:9",), max_request_bytes=2048)),
                        raise_server_exceptions=False)
    for method, path, status in (("GET", "/nope", 404), ("PUT", "/v1/completions", 405),
                                 ("GET", "/v1/chat/completions", 405)):
        r = client.request(method, path)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    r = client.post("/v1/completions", content=b'{"prompt": "' + b"a" * 4096 + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


@pytest.fixture(scope="module")
def fake_backend():
    """A backend without a model on a free port: /health, /v1/models/{id}, and completions that
    answer the body they got (with kv_transfer_params, as a producer does), after ``sleep``
    seconds when the body asks, in a list when it asks ``as_list``."""
    import json
    import threading
    import time

    import uvicorn
    from fastapi import Body, FastAPI, Response

    from tests.server.conftest import free_port
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str):
        return {"id": model_id, "object": "model"}

    @app.post("/v1/completions")
    async def completions(body: dict = Body(...)):
        import asyncio
        await asyncio.sleep(body.get("sleep", 0))
        answer = {"got": body, "kv_transfer_params": {"remote_request_id": None}}
        if body.get("as_list"):   # (JSON that is not an object)
            answer = [answer]
        return Response(json.dumps(answer), media_type="application/json")   # (escapes a lone surrogate)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True


def test_router_timeout_is_a_504_and_the_backend_stays_up(fake_backend):
    """A backend slower than --request-timeout: a 504 OpenAI error, the backend neither marked
    down nor given the request again, the next request served (before: a 503 "no backend is up",
    every replica tried in turn and marked down); a lone surrogate crosses the disaggregated
    router's prefill hop escaped (httpx's encoding raised: a 500); /v1/models/{id} is relayed."""
    from fastapi.testclient import TestClient

    from blitzllm.router.app import RouterConfig, build_router_app
    for cfg in (RouterConfig(backends=(fake_backend,), request_timeout_s=0.5),
                RouterConfig(prefill=(fake_backend,), decode=(fake_backend,), request_timeout_s=0.5)):
        with TestClient(build_router_app(cfg)) as client:
            r = client.post("/v1/completions", json={"prompt": "slow", "sleep": 2})
            assert r.status_code == 504 and r.json()["error"]["code"] == "backend_timeout", r.text
            assert client.get("/health").status_code == 200
            r = client.post("/v1/completions", content=b'{"prompt": "\\ud800 quick"}',
                            headers={"content-type": "application/json"})
            assert r.status_code == 200 and r.json()["got"]["prompt"] == "\ud800 quick", r.text
            assert client.get("/v1/models/m1").json()["id"] == "m1"
            metrics = client.get("/metrics").text
            assert 'status="timeout"' in metrics and 'status="unreachable"' not in metrics


def test_a_prefill_answer_that_is_not_an_object_goes_on_to_the_decode(fake_backend):
    """A producer's 200 whose JSON is not an object (a list) carries no kv_transfer_params: the
    decode runs the request whole (before: an AttributeError, a 500)."""
    from fastapi.testclient import TestClient

    from blitzllm.router.app import RouterConfig, build_router_app
    with TestClient(build_router_app(RouterConfig(prefill=(fake_backend,), decode=(fake_backend,)))) as client:
        r = client.post("/v1/completions", json={"prompt": "listed", "as_list": True})
        assert r.status_code == 200 and r.json()[0]["got"]["prompt"] == "listed", r.text
        assert "kv_transfer_params" not in r.json()[0]["got"]
