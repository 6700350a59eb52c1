"""Issue 36, findings 2, 6 and 7: text with a lone UTF-16 surrogate is a 400 naming the field on
every text path (never a 500); the ``Bearer`` scheme is case-insensitive; every response carries an
``X-Request-Id`` (the client's, echoed, or a generated one) that is the request's id; a malformed
``tools`` entry gets a readable message."""
from __future__ import annotations

import re

import httpx
import pytest
from server_helpers import check_error

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
LONE = r"a\udfffb"   # JSON text: a lone low surrogate between two letters

# (id, path, raw JSON body with a lone surrogate, the field the 400 must name)
SURROGATES = [
    ("completion_prompt", CMPL, '{"prompt": "%s", "max_tokens": 2}' % LONE, "prompt"),
    ("completion_prompt_list", CMPL, '{"prompt": ["ok", "%s"], "max_tokens": 2}' % LONE, "prompt.1"),
    ("completion_high_surrogate", CMPL, r'{"prompt": "x\ud800", "max_tokens": 2}', "prompt"),
    ("completion_stop", CMPL, '{"prompt": "Hi", "max_tokens": 2, "stop": ["%s"]}' % LONE, "stop.0"),
    ("chat_content", CHAT, '{"messages": [{"role": "user", "content": "%s"}], "max_tokens": 2}' % LONE,
     "messages.0.content"),
    ("chat_content_part", CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}], '
     '"max_tokens": 2}' % LONE, "messages.0.content.0.text"),
    ("chat_second_message", CHAT, '{"messages": [{"role": "system", "content": "Be brief."}, '
     '{"role": "user", "content": "%s"}], "max_tokens": 2}' % LONE, "messages.1.content"),
    ("chat_tools", CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "tool_choice": '
     '"none", "tools": [{"type": "function", "function": {"name": "f", "description": "%s"}}]}' % LONE,
     "tools.0.function.description"),
    ("tokenize_prompt", "/tokenize", '{"prompt": "%s"}' % LONE, "prompt"),
    ("tokenize_messages", "/tokenize", '{"messages": [{"role": "user", "content": "%s"}]}' % LONE,
     "messages.0.content"),
    ("surrogate_in_a_key", CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, '
     '"chat_template_kwargs": {"%s": 1}}' % LONE, "chat_template_kwargs"),
]


def ok(srv) -> None:
    r = httpx.post(srv.url + CMPL, json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("name,path,body,param", SURROGATES, ids=[c[0] for c in SURROGATES])
def test_lone_surrogate_is_a_400_naming_the_field(smol_server, name, path, body, param):
    r = httpx.post(smol_server.url + path, content=body.encode(), headers={"content-type": "application/json"},
                   timeout=60)
    err = check_error(r, 400, param)
    assert "surrogate" in err["message"] and err["code"] == "invalid_unicode", err
    assert "template rejected" not in err["message"] and "TypeError" not in err["message"]
    ok(smol_server)


def test_surrogate_pairs_are_fine(smol_server):
    """A proper pair (an astral character, escaped) is valid text: 200, and the same tokens as the
    character sent as UTF-8."""
    esc = httpx.post(smol_server.url + "/tokenize", content=rb'{"prompt": "x\ud83d\ude00y"}',
                     headers={"content-type": "application/json"}, timeout=60)
    assert esc.status_code == 200, esc.text
    raw = httpx.post(smol_server.url + "/tokenize", json={"prompt": "x\U0001F600y"}, timeout=60)
    assert esc.json()["tokens"] == raw.json()["tokens"]


def test_bearer_scheme_is_case_insensitive(tiny_server):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        r = httpx.post(tiny_server.url + CMPL, json=body, headers={"Authorization": f"{scheme} sesame"}, timeout=60)
        assert r.status_code == 200, (scheme, r.text)
    for bad in ("bearer wrong", "Basic sesame", "sesame", "bearer", "bearer  sesame x"):
        check_error(httpx.post(tiny_server.url + CMPL, json=body, headers={"Authorization": bad}, timeout=60),
                    401, None)


_RID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def test_request_id_on_every_response(smol_server):
    url = smol_server.url
    plain = [httpx.get(url + "/health"), httpx.get(url + "/metrics"), httpx.get(url + "/v1/models"),
             httpx.get(url + "/v1/nothing"), httpx.post(url + "/tokenize", json={"prompt": "x"}),
             httpx.post(url + CMPL, content=b"{", headers={"content-type": "application/json"}),
             httpx.post(url + CMPL, json={"prompt": "Hi", "max_tokens": 1}, timeout=60)]
    seen = set()
    for r in plain:
        rid = r.headers.get("x-request-id")
        assert rid and _RID.match(rid), (r.request.url, r.headers)
        seen.add(rid)
    assert len(seen) == len(plain)   # generated afresh for each
    # the client's id is echoed and is the request's id (the engine's, the response body's)
    r = httpx.post(url + CMPL, json={"prompt": "Hi", "max_tokens": 1}, headers={"X-Request-Id": "abc-123"},
                   timeout=60)
    assert r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"
    r = httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
                   headers={"x-request-id": "chat-7"}, timeout=60)
    assert r.headers["x-request-id"] == "chat-7" and r.json()["id"] == "chatcmpl-chat-7"
    with httpx.stream("POST", url + CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                               "stream": True}, headers={"X-Request-Id": "s-1"}, timeout=60) as r:
        assert r.headers["x-request-id"] == "s-1"
        assert '"id":"chatcmpl-s-1"' in r.read().decode()
    r = httpx.post(url + CMPL, json={"prompt": "Hi", "max_tokens": 0}, headers={"X-Request-Id": "bad-1"})
    assert r.headers["x-request-id"] == "bad-1"
    # an id that is not a printable token is replaced, not echoed
    r = httpx.get(url + "/health", headers={"X-Request-Id": "x" * 300})
    assert r.headers["x-request-id"] != "x" * 300 and _RID.match(r.headers["x-request-id"])


def test_request_id_in_use_is_a_400(smol_server):
    """Two requests in flight with one X-Request-Id: the second is refused (ids name one request)."""
    import threading
    body = {"prompt": "Count", "max_tokens": 40, "ignore_eos": True, "stream": True}
    started, done = threading.Event(), threading.Event()

    errors = []

    def first():
        try:
            with httpx.stream("POST", smol_server.url + CMPL, json=body, headers={"X-Request-Id": "dup"},
                              timeout=120) as r:
                for line in r.iter_lines():
                    started.set()
                    if line == "data: [DONE]":
                        return
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    t = threading.Thread(target=first, daemon=True)
    t.start()
    assert started.wait(60)
    try:
        r = httpx.post(smol_server.url + CMPL, json={"prompt": "Hi", "max_tokens": 1},
                       headers={"X-Request-Id": "dup"}, timeout=60)
        err = check_error(r, 400, None)
        assert "dup" in err["message"] and err["code"] == "duplicate_request_id"
    finally:
        done.set()
        t.join(60)
    assert not t.is_alive() and not errors, errors   # the first request was left alone


def test_malformed_tools_message(smol_server):
    r = httpx.post(smol_server.url + CHAT, json={"messages": [{"role": "user", "content": "Hi"}],
                                                 "tools": [{"type": "function"}], "tool_choice": "required"},
                   timeout=60)
    err = check_error(r, 400, "tools.0")
    msg = err["message"]
    assert msg.count("{") == msg.count("}"), msg
    assert "'type': 'function'" in msg and "'name'" in msg


@pytest.mark.parametrize("arguments", ['{"a": ' + "1" * 5000 + "}", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"],
                         ids=["integer_past_the_digit_limit", "nested_too_deep"])
def test_earlier_tool_call_arguments_that_json_cannot_read_stay_text(smol_server, arguments):
    """An assistant turn's tool-call ``arguments`` that Python's json cannot read (an integer past
    int's digit limit, nesting past the recursion limit) go to the template as the string they
    are, on chat and /tokenize: 200, not a 500."""
    messages = [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                      "function": {"name": "f", "arguments": arguments}}]},
                {"role": "user", "content": "Hi"}]
    for path, body in ((CHAT, {"messages": messages, "max_tokens": 2}), ("/tokenize", {"messages": messages})):
        r = httpx.post(smol_server.url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
    ok(smol_server)


def test_an_internal_error_is_a_json_500_that_closes_the_connection():
    """A handler's unexpected exception: an OpenAI-style 500 with ``Connection: close`` (the server
    drops the connection after it, so a client must not reuse it) and the request id."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from blitzllm.server.errors import install_error_handlers
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("boom")
    r = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert r.status_code == 500 and r.headers["connection"] == "close"
    assert r.json()["error"]["type"] == "server_error" and "RuntimeError" in r.json()["error"]["message"]


def test_a_client_gone_while_sending_its_body_is_a_quiet_400():
    import asyncio

    from starlette.requests import ClientDisconnect

    from blitzllm.server.errors import APIError, read_body

    class Gone:
        headers: dict = {}

        async def stream(self):
            yield b'{"prompt": '
            raise ClientDisconnect()
    with pytest.raises(APIError) as e:
        asyncio.run(read_body(Gone(), 1 << 20))
    assert e.value.status == 400 and e.value.code == "client_disconnected"


@pytest.mark.parametrize("header,status", [("12x", 400), ("-3", 400), ("99999999", 413), ("17", None)])
def test_content_length_is_checked_before_the_body_is_read(header, status):
    """A Content-Length that is no size (not a number, negative) is a 400 and one over the limit a
    413, both before a byte is read; a good one reads the body."""
    import asyncio

    from blitzllm.server.errors import APIError, read_body

    class Body:
        headers = {"content-length": header}
        read = False

        async def stream(self):
            Body.read = True
            yield b'{"prompt": "Hi"}'
    if status is None:
        assert asyncio.run(read_body(Body(), 1 << 20)) == b'{"prompt": "Hi"}'
        return
    with pytest.raises(APIError) as e:
        asyncio.run(read_body(Body(), 1 << 20))
    assert e.value.status == status and not Body.read


def test_continue_final_message_continues_the_assistant_text(smol_server):
    """continue_final_message (vLLM's): the conversation rendered with the final assistant message
    left open (transformers' apply_chat_template(continue_final_message=True), no end of turn, no
    new turn), and the greedy answer is the model's continuation of it: the same tokens as a
    completion of that text; with add_generation_prompt left true it is a 400."""
    from blitzllm.loader.source import smollm2_path
    from blitzllm.loader.tokenizer import load_gguf_tokenizer
    tok = load_gguf_tokenizer(smollm2_path())
    msgs = [{"role": "user", "content": "Name the capital of France."},
            {"role": "assistant", "content": "The capital of France is"}]
    text = tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    assert text.endswith("The capital of France is")
    r = httpx.post(smol_server.url + "/tokenize", json={"messages": msgs, "add_generation_prompt": False,
                                                        "continue_final_message": True}, timeout=60)
    assert r.status_code == 200 and r.json()["tokens"] == tok(text, add_special_tokens=False)["input_ids"], r.text
    chat = httpx.post(smol_server.url + CHAT, json={"messages": msgs, "add_generation_prompt": False,
                                                    "continue_final_message": True, "max_tokens": 6,
                                                    "temperature": 0}, timeout=60)
    cmpl = httpx.post(smol_server.url + CMPL, json={"prompt": text, "max_tokens": 6, "temperature": 0}, timeout=60)
    assert chat.status_code == 200 and cmpl.status_code == 200, (chat.text, cmpl.text)
    assert chat.json()["choices"][0]["message"]["content"] == cmpl.json()["choices"][0]["text"]
    r = httpx.post(smol_server.url + CHAT, json={"messages": msgs, "continue_final_message": True,
                                                 "max_tokens": 2}, timeout=60)
    check_error(r, 400, param="continue_final_message")


def test_tool_choice_required_with_no_tools_is_a_400(smol_server):
    """A forced call among no tools cannot be made (before: a 200 whose content was "[]")."""
    r = httpx.post(smol_server.url + CHAT, json={"messages": [{"role": "user", "content": "hi"}], "tools": [],
                                                 "tool_choice": "required", "max_tokens": 4}, timeout=60)
    check_error(r, 400, param="tools")
    ok(smol_server)
