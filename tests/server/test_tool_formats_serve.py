"""``blitz serve --enable-auto-tool-choice --tool-call-parser llama3_json | pythonic | mistral``
over HTTP: a tiny random Llama whose chat template renders the tools writes a call in each
format (a regex makes it), and chat completions hand it back as ``tool_calls`` with
finish_reason ``tool_calls``, streamed and not; mistral's requests decode special tokens, so
its ``[TOOL_CALLS]`` token reaches the parser. (The formats' own cases: test_tool_formats.py.)"""
from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import stream_chat

from tests.conftest import needs_xgrammar
from tests.server.conftest import ServerProcess, _tiny_llama, running, with_chat_template

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# (parser, a regex for what the model writes, the content left beside the call)
WRITES = {
    "llama3_json": (r'Checking\.\n\{"name": "get_weather", "parameters": \{"city": "Paris", "days": 3\}\}', "Checking.\n"),
    "pythonic": (r'\[get_weather\(city="Paris", days=3\)\]', None),
    "mistral": (r'Sure\.\[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "Paris", "days": 3\}', "Sure."),
}


@pytest.fixture(scope="module", params=list(WRITES))
def tool_server(request, tmp_path_factory):
    folder = with_chat_template(_tiny_llama(tmp_path_factory.mktemp("tiny-tools"),
                                            special_tokens=("[TOOL_CALLS]", "[ARGS]")), TEMPLATE)
    srv = ServerProcess(["--model", str(folder), "--served-model-name", "tools", "--enable-auto-tool-choice",
                         "--tool-call-parser", request.param, "--max-model-len", "512", "--kv-cache-blocks", "64"],
                        tmp_path_factory.mktemp(request.param) / "server.log")
    srv.parser = request.param
    yield from running(srv)


def _chat(srv, stream: bool, **extra) -> tuple:
    body = {"messages": ASK, "tools": TOOLS, "temperature": 0, "stream": stream, **extra}
    if stream:
        parts, calls, reason = stream_chat(srv.url, body)
        return parts["content"], calls, reason
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"], choice["message"].get("tool_calls") or [], choice["finish_reason"]


@needs_xgrammar
@pytest.mark.parametrize("stream", [False, True])
def test_a_call_comes_back_as_tool_calls(tool_server, stream):
    regex, content = WRITES[tool_server.parser]
    got, calls, reason = _chat(tool_server, stream, max_tokens=80, structured_outputs={"regex": regex})
    assert reason == "tool_calls", (got, calls)
    assert got == (content or "") if stream else got == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris", "days": 3})]
    assert calls[0]["type"] == "function" and (calls[0].get("index") == 0 if stream else True)
    ids = [c["id"] for c in calls]
    assert all(len(i) == 9 and i.isalnum() for i in ids) if tool_server.parser == "mistral" else \
        all(i.startswith("call_") for i in ids)


def test_plain_text_stays_content(tool_server):
    """No call in the answer: content, finish_reason as the engine says; with mistral, the
    [TOOL_CALLS] special token is decoded (a logit bias makes the model write it), so an answer
    holding it without a call keeps it in the content."""
    for stream in (False, True):
        got, calls, reason = _chat(tool_server, stream, max_tokens=4)
        assert calls == [] and reason in ("stop", "length")
    if tool_server.parser == "mistral":
        tok = httpx.post(tool_server.url + "/tokenize", json={"prompt": "[TOOL_CALLS]", "add_special_tokens": False},
                         timeout=30).json()["tokens"]
        assert len(tok) == 1
        for stream in (False, True):
            got, calls, _ = _chat(tool_server, stream, max_tokens=2, logit_bias={str(tok[0]): 100})
            assert got == "[TOOL_CALLS]" * 2 and calls == []
