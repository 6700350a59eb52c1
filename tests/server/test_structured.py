"""response_format json_object / json_schema on the real server (SmolLM2): answers parse as
JSON of the asked shape, streamed too; bad formats are 400s and the server keeps serving."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import needs_xgrammar


# Only the tests whose answer comes from a compiled grammar need xgrammar (without it the server
# answers 400 "structured outputs need xgrammar", which would pass the two error cases marked
# below for the wrong reason); the request validation runs without it.

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
MSG = [{"role": "user", "content": "Describe a person as JSON with name, age and city."}]


def _chat(srv, stream=False, **extra):
    body = {"messages": MSG, "max_tokens": 80, "temperature": 0, "stream": stream, **extra}
    if not stream:
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"]
    text, reason = "", None
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    text += ch["delta"].get("content") or ""
                    reason = ch["finish_reason"] or reason
    return text, reason


@needs_xgrammar
def test_json_schema(smol_server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    text, reason = _chat(smol_server, response_format=fmt)
    obj = json.loads(text)
    assert reason == "stop" and list(obj) == ["name", "age", "city"] and isinstance(obj["age"], int)
    assert _chat(smol_server, stream=True, response_format=fmt) == (text, reason)


@needs_xgrammar
def test_json_object(smol_server):
    text, reason = _chat(smol_server, response_format={"type": "json_object"})
    assert reason == "stop" and isinstance(json.loads(text), dict)
    plain, _ = _chat(smol_server)
    assert plain != text  # (unconstrained, the model answers in prose around its JSON)


@pytest.mark.parametrize("fmt", [{"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 3}},
                                 {"type": "regex"},
                                 pytest.param({"type": "json_schema", "json_schema": {"schema": {"type": "x"}}},
                                              marks=needs_xgrammar),
                                 {"type": "structural_tag", "structures": [], "triggers": ["<f"]},
                                 pytest.param({"type": "structural_tag", "format": {"type": "no_such_format"}},
                                              marks=needs_xgrammar)])
def test_bad_formats(smol_server, fmt):
    r = httpx.post(smol_server.url + "/v1/chat/completions", json={"messages": MSG, "response_format": fmt},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert httpx.get(smol_server.url + "/health", timeout=10).status_code == 200


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@needs_xgrammar
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_choices(smol_server, stream):
    """A named function and "required" decode the calls' JSON (no tool-call parser on this
    server: forced choices need none): tool_calls of the asked shape, finish_reason "stop"."""
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        body = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": choice, "max_tokens": 80,
                "temperature": 0, "stream": stream}
        calls, reason, content = [], None, ""
        if stream:
            with httpx.stream("POST", smol_server.url + "/v1/chat/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        for ch in json.loads(line[6:])["choices"]:
                            calls += ch["delta"].get("tool_calls") or []
                            content += ch["delta"].get("content") or ""
                            reason = ch["finish_reason"] or reason
        else:
            r = httpx.post(smol_server.url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            msg = r.json()["choices"][0]["message"]
            calls, reason, content = msg.get("tool_calls") or [], r.json()["choices"][0]["finish_reason"], msg["content"]
        assert reason == "stop" and calls and not content, (calls, content)
        names = [c["function"]["name"] for c in calls]
        assert set(names) <= {"get_weather", "get_time"} and (choice == "required" or names == ["get_weather"])
        for c in calls:
            args = json.loads(c["function"]["arguments"])
            assert list(args) == (["city"] if c["function"]["name"] == "get_weather" else ["timezone"])
            assert c["type"] == "function" and c["id"].startswith("call_")


@pytest.mark.parametrize("body", [
    {"structured_outputs": {"choice": ["yes", "no"]}},
    {"guided_choice": ["yes", "no"]},
    {"structured_outputs": {"regex": "(yes|no)"}},
])
@needs_xgrammar
def test_vllm_structured_outputs_fields(smol_server, body):
    """vLLM's structured_outputs / guided_* fields, on chat and on completions."""
    r = httpx.post(smol_server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "Is the sky blue?"}], "max_tokens": 8, **body},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")
    r = httpx.post(smol_server.url + "/v1/completions",
                   json={"prompt": "Is the sky blue? Answer:", "max_tokens": 8, **body}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("yes", "no")


@pytest.mark.parametrize("body,param", [
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs.regex"),
    pytest.param({"guided_regex": "(", "max_tokens": 4}, "guided_regex", marks=needs_xgrammar),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "response_format"),
])
def test_vllm_structured_outputs_errors(smol_server, body, param):
    r = httpx.post(smol_server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


TAG = {"structures": [{"begin": " get_weather", "schema": WEATHER["function"]["parameters"], "end": "."}],
       "triggers": [" get"]}
TAG_ASK = [{"role": "system", "content": "To call a function, write get_weather{json args}."},
           {"role": "user", "content": "What's the weather in Paris? Call get_weather."}]


@needs_xgrammar
@pytest.mark.parametrize("how", ["response_format", "structured_outputs"])
def test_structural_tag(smol_server, how):
    """vLLM's structural_tag, as a response_format (its legacy form's fields beside "type") and as
    structured_outputs.structural_tag (a JSON string): the free text before the trigger, then the
    tag's JSON and its end (tests/engine/test_structured_output.py::test_structural_tag)."""
    extra = ({"response_format": {"type": "structural_tag", **TAG}} if how == "response_format"
             else {"structured_outputs": {"structural_tag": json.dumps(TAG)}})
    r = httpx.post(smol_server.url + "/v1/chat/completions",
                   json={"messages": TAG_ASK, "max_tokens": 40, "temperature": 0, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert text.startswith("To call get_weather{"), text
    obj, end = json.JSONDecoder().raw_decode(text, len("To call get_weather"))
    assert list(obj) == ["city"] and text[end] == "."
