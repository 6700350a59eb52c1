"""Reasoning outputs (``--reasoning-parser``): the splitter on hand-derived cases, streamed in
every chunking equal to the whole; and a real ``blitz serve`` of a tiny random model whose chat
template opens ``<think>`` unless ``chat_template_kwargs`` says ``enable_thinking: false``:
its chat answers come back as reasoning_content or as content, streamed and not, equal to the
raw text /v1/completions gives for the same prompt. The same server takes tools
(``--enable-auto-tool-choice --tool-call-parser hermes``, its template renders them and earlier
tool calls): they reach the prompt, ``tool_choice: none`` leaves them out, earlier calls' JSON
arguments reach the template as mappings, unsupported choices are 400s."""
from __future__ import annotations

import random

import httpx
import pytest

from blitzllm.server.reasoning import (AppendThink, ThinkSplitter, make_splitter, prompt_opens_thinking,
                                       split_reasoning)
from tests.server.server_helpers import stream_chat

CASES = [
    # (prompt left a <think> open, output, reasoning_content, content)
    (True, "step one</think>\n\nParis", "step one", "\n\nParis"),             # R1: the prompt opened it
    (True, "never closed", "never closed", None),                           # all reasoning
    (True, "a</think>", "a", None),                                          # nothing after the block
    (False, "<think>\nhmm\n</think>\n\nyes", "\nhmm\n", "\n\nyes"),           # Qwen3 opens its own
    (False, "  \n<think>x</think>y", "x", "y"),                              # after leading whitespace
    (False, "plain answer", None, "plain answer"),                           # thinking off
    (False, "<thinking> is not the tag", None, "<thinking> is not the tag"),
    (False, "a <think> later is text", None, "a <think> later is text"),
    (True, "ends on a partial </thi", "ends on a partial </thi", None),       # a held tail is text
    (False, "<thi", None, "<thi"),
    (False, "", None, ""),
    (True, "x</think>y</think>z", "x", "y</think>z"),                        # only the first closes
]


@pytest.mark.parametrize("opened,text,reasoning,content", CASES)
def test_split_whole(opened, text, reasoning, content):
    assert split_reasoning(ThinkSplitter(opened), text) == (reasoning, content)


@pytest.mark.parametrize("opened,text,reasoning,content", CASES)
def test_split_streamed_in_every_chunking(opened, text, reasoning, content):
    """Every split into two pieces, and random splits into many, join to the whole's parts."""
    rng = random.Random(len(text))
    cuts = [[i] for i in range(len(text) + 1)] + [sorted(rng.sample(range(len(text) + 1), min(len(text), 5)))
                                                   for _ in range(20)]
    for cut in cuts:
        sp = ThinkSplitter(opened)
        pieces = [text[a:b] for a, b in zip([0] + cut, cut + [len(text)])]
        got_r, got_c = zip(*[sp.feed(p) for p in pieces], sp.finish())
        assert "".join(got_r) == (reasoning or "") and "".join(got_c) == (content or ""), cut


def test_prompt_opens_thinking_and_append_think():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("no tags")
    assert prompt_opens_thinking("<think>a</think> then <think>")
    assert split_reasoning(AppendThink(True), "r</think>c") == (None, "<think>r</think>c")
    assert split_reasoning(AppendThink(False), "c") == (None, "c")
    assert make_splitter(None, "<think>") is None
    with pytest.raises(ValueError, match="reasoning parser must be one of"):
        make_splitter("r1", "")


def _prompt(srv, messages, tools=None, **template_kwargs) -> list:
    body = {"messages": messages, **({"chat_template_kwargs": template_kwargs} if template_kwargs else {}),
            **({"tools": tools} if tools else {})}
    r = httpx.post(srv.url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _raw(srv, messages, **template_kwargs) -> str:
    """The same prompt's greedy text through /v1/completions (no parser there)."""
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": _prompt(srv, messages, **template_kwargs),
                                                      "max_tokens": 12, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _chat(srv, messages, stream=False, **extra):
    body = {"messages": messages, "max_tokens": 12, "temperature": 0, "stream": stream, **extra}
    if not stream:
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]
    return stream_chat(srv.url, body, 60)[0]


def test_thinking_on_comes_back_as_reasoning(thinking_server):
    msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    raw = _raw(thinking_server, msgs)
    assert raw and "</think>" not in raw and not raw.lstrip().startswith("<think>")
    msg = _chat(thinking_server, msgs)
    assert msg["reasoning_content"] == raw and msg["content"] is None
    assert _chat(thinking_server, msgs, stream=True) == {"reasoning_content": raw, "content": ""}


def test_thinking_off_by_template_kwargs_comes_back_as_content(thinking_server):
    msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    raw = _raw(thinking_server, msgs, enable_thinking=False)
    assert raw and "<think>" not in raw
    on, off_ids = _prompt(thinking_server, msgs), _prompt(thinking_server, msgs, enable_thinking=False)
    assert off_ids != on and len(off_ids) > len(on)  # the kwargs reached the template: the block closed
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    msg = _chat(thinking_server, msgs, **off)
    assert msg["reasoning_content"] is None and msg["content"] == raw
    assert _chat(thinking_server, msgs, stream=True, **off) == {"reasoning_content": "", "content": raw}


def test_template_kwargs_errors(thinking_server):
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(thinking_server.url + "/v1/chat/completions",
                   json={"messages": msgs, "chat_template_kwargs": {"tokenize": False}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    r = httpx.post(thinking_server.url + "/v1/chat/completions",
                   json={"messages": msgs, "chat_template_kwargs": ["enable_thinking"]}, timeout=30)
    assert r.status_code == 400 or r.status_code == 422
    assert httpx.get(thinking_server.url + "/health", timeout=10).status_code == 200


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def test_tools_reach_the_template(thinking_server):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools, plain = _prompt(thinking_server, msgs, tools=TOOLS), _prompt(thinking_server, msgs)
    text = httpx.post(thinking_server.url + "/detokenize", json={"tokens": with_tools}, timeout=30).json()["prompt"]
    assert len(with_tools) > len(plain) and '"name": "get_weather"' in text
    r = httpx.post(thinking_server.url + "/v1/chat/completions",
                   json={"messages": msgs, "tools": TOOLS, "max_tokens": 12, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    # (the random model writes no call: its text comes back as before, nothing parsed away)
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] in ("stop", "length")
    assert choice["message"]["reasoning_content"] == _raw_ids(thinking_server, with_tools)


def _raw_ids(srv, ids) -> str:
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": ids, "max_tokens": 12, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_tool_choice_none_leaves_the_tools_out(thinking_server):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    without = _chat(thinking_server, msgs)
    assert _chat(thinking_server, msgs, tools=TOOLS, tool_choice="none") == without


def test_earlier_tool_calls_and_results_reach_the_template(thinking_server):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    ids = _prompt(thinking_server, msgs, tools=TOOLS)
    text = httpx.post(thinking_server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    # the arguments string went to the template as a mapping (a string would render quoted)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\n18 C, sunny" in text
    r = httpx.post(thinking_server.url + "/v1/chat/completions",
                   json={"messages": msgs, "tools": TOOLS, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("extra,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools.0"),
    ({"tool_choice": "auto"}, "tool_choice"),
])
def test_tool_request_errors(thinking_server, extra, param):
    r = httpx.post(thinking_server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], **extra}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
