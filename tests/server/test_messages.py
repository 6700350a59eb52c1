"""POST /v1/messages (Anthropic's Messages API) on a real ``blitz serve`` of SmolLM2, through the
official ``anthropic`` client: answers equal what /v1/chat/completions gives for the same
conversation (greedy), streamed ones equal the whole ones, stop sequences and max_tokens give
their stop reasons, forced tool uses and their results round trip, count_tokens counts the
prompt a message request runs, bad requests are Anthropic-shaped 4xx that leave the engine
serving, a dropped stream frees its KV blocks, and x-api-key is a key. A tiny thinking model
(conftest's ``thinking_server``) gives thinking blocks. The conversion and the content builder
are tested without a server at the end."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from blitzllm.server import messages_protocol as M
from tests.conftest import needs_xgrammar
from tests.server.server_helpers import drop_stream_midway, rejected, tokens_of, wait_idle

MODEL = "smollm2"
ASK = "What is the capital of France?"
GREEDY = {"temperature": 0}   # (the SDK has no sampling arguments: extra_body)
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"timezone": {"type": "string"}},
                                             "required": ["timezone"], "additionalProperties": False}}


def sdk(srv, **kw) -> anthropic.Anthropic:
    """The official client on a test server."""
    return anthropic.Anthropic(base_url=srv.url, api_key=srv.api_key or "unused", max_retries=0, timeout=300, **kw)


def create(srv, **kw) -> Message:
    return sdk(srv).messages.create(model=kw.pop("model", MODEL), extra_body={**GREEDY, **kw.pop("extra", {})}, **kw)


def chat(srv, messages, **body) -> dict:
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, **GREEDY, **body},
                   headers=srv.headers(), timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def raw_message(srv, **body) -> dict:
    """A message's JSON as the server sends it, checked against the SDK's type and the documented model."""
    r = httpx.post(srv.url + "/v1/messages", json={"model": MODEL, **GREEDY, **body}, headers=srv.headers(),
                   timeout=300)
    assert r.status_code == 200, r.text
    Message.model_validate(r.json())
    M.MessageObject.model_validate(r.json())
    return r.json()


def prompt_tokens(usage) -> int:
    """The whole prompt of a message's usage (Anthropic's: the prefix cache's part apart)."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def same(msg) -> dict:
    """A message as JSON without what differs between two runs of one request: its ids, and how
    the prefix cache split the prompt (the total stays)."""
    d = msg.model_dump(mode="json", exclude_none=True)
    d.pop("id")
    d["usage"] = {"prompt": prompt_tokens(msg.usage), "output_tokens": msg.usage.output_tokens}
    for block in d["content"]:
        block.pop("parsed_output", None)
        if block["type"] == "tool_use":
            block.pop("id")
    return d


def check_error(r: httpx.Response, status: int, kind: str, where=None) -> dict:
    """Anthropic's error body: the status, its type, and the field named in the message."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    M.AnthropicError.model_validate(body)
    assert set(body) == {"type", "error", "request_id"} and body["type"] == "error"
    assert body["error"]["type"] == kind and body["request_id"] == r.headers["x-request-id"]
    if where is not None:
        assert body["error"]["message"].startswith((where, f"'{where}'")), body
    return body["error"]


def test_text_equals_chat(smol_server):
    """One user message: the text, the token counts and the stop equal chat's; the body is the
    SDK's Message, and nothing undocumented."""
    want = chat(smol_server, [{"role": "user", "content": ASK}], max_tokens=24)
    body = raw_message(smol_server, max_tokens=24, messages=[{"role": "user", "content": ASK}])
    assert body["id"].startswith("msg_")
    assert (body["type"], body["role"], body["model"]) == ("message", "assistant", MODEL)
    [block] = body["content"]
    assert block == {"type": "text", "text": want["choices"][0]["message"]["content"]} and "Paris" in block["text"]
    finish = want["choices"][0]["finish_reason"]
    assert body["stop_reason"] == {"stop": "end_turn", "length": "max_tokens"}[finish] and body["stop_sequence"] is None
    u = body["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] == want["usage"]["prompt_tokens"]
    assert 0 < u["cache_read_input_tokens"] < want["usage"]["prompt_tokens"]   # (chat just ran this prompt)
    assert u["cache_creation_input_tokens"] == 0 and u["output_tokens"] == want["usage"]["completion_tokens"]
    got = create(smol_server, max_tokens=24, messages=[{"role": "user", "content": ASK}])
    assert got.content[0].text == block["text"] and got.stop_reason == body["stop_reason"]


def test_system_and_turns_equal_chat(smol_server):
    """``system`` (a string, or text blocks joined by newlines, Claude Code's billing-header block
    left out) is the first message; text blocks join as chat's content parts do; earlier turns
    as chat's."""
    history = [{"role": "user", "content": "My name is Bob."}, {"role": "assistant", "content": "Hello Bob!"},
               {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "my name?"}]}]
    want = chat(smol_server, [{"role": "system", "content": "Answer in one word.\nBe brief."}] + history,
                max_tokens=12)
    blocks = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
              {"type": "text", "text": "Answer in one word."}, {"type": "text", "text": "Be brief."}]
    assistant = {"role": "assistant", "content": [{"type": "text", "text": "Hello Bob!"}]}
    for system, turns in (("Answer in one word.\nBe brief.", history),
                          (blocks, [history[0], assistant, history[2]])):
        got = create(smol_server, max_tokens=12, system=system, messages=turns)
        assert got.content[0].text == want["choices"][0]["message"]["content"]
        assert prompt_tokens(got.usage) == want["usage"]["prompt_tokens"]
    plain = create(smol_server, max_tokens=12, messages=history)
    chat_plain = [*history[:2], {"role": "user", "content": "What is\nmy name?"}]
    assert prompt_tokens(plain.usage) == tokens_of(smol_server, messages=chat_plain) != want["usage"]["prompt_tokens"]


def test_stop_sequence(smol_server):
    """A stop sequence taken from the greedy answer ends it there: stop_reason stop_sequence."""
    text = create(smol_server, max_tokens=40, messages=[{"role": "user", "content": ASK}]).content[0].text
    words = text.split()
    stop = next(w for w in words[len(words) // 2:] if text.index(w) > 0)
    got = create(smol_server, max_tokens=40, messages=[{"role": "user", "content": ASK}],
                 stop_sequences=["never appears", stop])
    assert (got.stop_reason, got.stop_sequence) == ("stop_sequence", stop)
    assert got.content[0].text == text[:text.index(stop)]


def test_max_tokens(smol_server):
    want = chat(smol_server, [{"role": "user", "content": "Tell me a long story."}], max_tokens=3)
    got = create(smol_server, max_tokens=3, messages=[{"role": "user", "content": "Tell me a long story."}])
    assert (got.stop_reason, got.stop_sequence, got.usage.output_tokens) == ("max_tokens", None, 3)
    assert got.content[0].text == want["choices"][0]["message"]["content"]


def test_prefill_continues_the_final_assistant_message(smol_server):
    """A final assistant message is continued (Anthropic's prefill): chat's continue_final_message."""
    turns = [{"role": "user", "content": ASK}, {"role": "assistant", "content": "The capital of France is"}]
    want = chat(smol_server, turns, max_tokens=8, add_generation_prompt=False, continue_final_message=True)
    got = create(smol_server, max_tokens=8, messages=turns)
    assert got.content[0].text == want["choices"][0]["message"]["content"]
    assert prompt_tokens(got.usage) == want["usage"]["prompt_tokens"]


def test_stream_equals_non_stream(smol_server):
    """client.messages.stream: Anthropic's event sequence, deltas adding up to the text, and a
    final message equal to the non-streaming one; each event as documented."""
    c = sdk(smol_server)
    kw = dict(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": ASK}], extra_body=GREEDY)
    whole = c.messages.create(**kw)
    assert whole.stop_reason == "end_turn"   # (SmolLM2 answers in fewer tokens)
    with c.messages.stream(**kw) as st:
        events = list(st)
        final = st.get_final_message()
    raw = [e for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                           "content_block_stop", "message_delta", "message_stop")]
    types = [e.type for e in raw]
    n = types.count("content_block_delta")
    assert n >= 3 and types == ["message_start", "content_block_start"] + ["content_block_delta"] * n + [
        "content_block_stop", "message_delta", "message_stop"]
    assert raw[0].message.content == [] and raw[0].message.stop_reason is None
    assert "".join(e.delta.text for e in raw if e.type == "content_block_delta") == whole.content[0].text
    assert same(final) == same(whole) and final.id == raw[0].message.id != whole.id
    # the wire: event names match the data's type, a ping after message_start, no [DONE]
    with httpx.stream("POST", smol_server.url + "/v1/messages", json={**kw.pop("extra_body"), **kw, "stream": True},
                      timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    pairs = list(zip(lines[::2], lines[1::2]))
    assert all(ev.startswith("event: ") and data.startswith("data: ") for ev, data in pairs) and len(lines) % 2 == 0
    for ev, data in pairs:
        obj = json.loads(data[len("data: "):])
        assert ev[len("event: "):] == obj["type"]
        M.MessageStreamEvent.model_validate(obj)
        if obj["type"] != "ping":
            TypeAdapter(RawMessageStreamEvent).validate_python(obj)
    assert [json.loads(d[6:])["type"] for _, d in pairs[:2]] == ["message_start", "ping"]


@needs_xgrammar
@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_forced_tool_use_equals_chat(smol_server, choice):
    """A forced tool choice decodes the call by a grammar (no tool-call parser on this server):
    tool_use blocks with chat's calls' names and parsed arguments, stop_reason tool_use; the
    stream's input_json_delta builds the same input."""
    chat_choice = "required" if choice["type"] == "any" else {"type": "function", "function": {"name": "get_weather"}}
    tools = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                               **({"description": t["description"]} if "description" in t else {})}}
             for t in (WEATHER, TIME)]
    want = chat(smol_server, [{"role": "user", "content": "What is the weather in Paris?"}], max_tokens=60,
                tools=tools, tool_choice=chat_choice)["choices"][0]["message"]
    kw = dict(max_tokens=60, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
              tools=[WEATHER, TIME], tool_choice=choice)
    got = create(smol_server, **kw)
    assert got.stop_reason == "tool_use" and all(b.type == "tool_use" for b in got.content)
    assert [(b.name, b.input) for b in got.content] == \
        [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in want["tool_calls"]]
    assert all(b.id.startswith("toolu_") and isinstance(b.input, dict) for b in got.content)
    with sdk(smol_server).messages.stream(model=MODEL, extra_body=GREEDY, **kw) as st:
        final = st.get_final_message()
    assert same(final) == same(got)
    one = create(smol_server, **{**kw, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert len(one.content) == 1 and one.content[0].type == "tool_use"


@needs_xgrammar
def test_tool_result_round_trip(smol_server):
    """An answer's tool_use block and the caller's tool_result go back as the chat template's
    assistant tool call and tool message: the prompt and the answer equal chat's."""
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    call = create(smol_server, max_tokens=60, messages=[ask], tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"}).content[0]
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "18 C and sunny"}
    turns = [ask, {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
             {"role": "user", "content": [result]}]
    answer = create(smol_server, max_tokens=30, messages=turns)
    messages = [ask, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    want = chat(smol_server, messages, max_tokens=30)
    assert prompt_tokens(answer.usage) == want["usage"]["prompt_tokens"] == tokens_of(smol_server, messages=messages)
    assert answer.content[0].text == want["choices"][0]["message"]["content"]
    as_blocks = {**result, "content": [{"type": "text", "text": "18 C and sunny"}], "is_error": False}
    again = create(smol_server, max_tokens=2, messages=turns[:2] + [{"role": "user", "content": [as_blocks]}])
    assert prompt_tokens(again.usage) == prompt_tokens(answer.usage)
    without = tokens_of(smol_server, messages=messages[:2] + [{**messages[2], "content": ""}])
    assert without < prompt_tokens(answer.usage)   # (the result reached the prompt)


def test_count_tokens_equals_the_message_prompt(smol_server):
    c = sdk(smol_server)
    for kw in (dict(messages=[{"role": "user", "content": ASK}]),
               dict(messages=[{"role": "user", "content": ASK}], system="Be brief."),
               dict(messages=[{"role": "user", "content": ASK}], tools=[WEATHER], tool_choice={"type": "none"})):
        counted = c.messages.count_tokens(model=MODEL, **kw).input_tokens
        got = create(smol_server, max_tokens=2, **kw)
        assert counted == prompt_tokens(got.usage) > 0
    assert counted == tokens_of(smol_server, messages=[{"role": "user", "content": ASK}])
    r = httpx.post(smol_server.url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": kw["messages"],
                                                                        "system": "Be brief."}, timeout=60)
    assert r.status_code == 200 and set(r.json()) == {"input_tokens"}
    assert r.json()["input_tokens"] == tokens_of(smol_server, messages=[{"role": "system", "content": "Be brief."},
                                                                         *kw["messages"]]) != counted
    M.TokenCount.model_validate(r.json())


@needs_xgrammar
def test_output_config_json_schema(smol_server):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    got = create(smol_server, max_tokens=60, messages=[{"role": "user", "content": "Describe a person as JSON."}],
                 output_config={"format": {"type": "json_schema", "schema": schema}})
    obj = json.loads(got.content[0].text)
    assert list(obj) == ["name", "age"] and isinstance(obj["age"], int) and got.stop_reason == "end_turn"
    want = chat(smol_server, [{"role": "user", "content": "Describe a person as JSON."}], max_tokens=60,
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert got.content[0].text == want["choices"][0]["message"]["content"]


def _user(*blocks) -> list:
    return [{"role": "user", "content": list(blocks)}]


BAD = [
    ({"messages": _user({"type": "image", "source": {"type": "url", "url": "x"}})}, "messages.0.content.0"),
    ({"messages": _user({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]})},
     "messages.0.content.0.content.0"),
    ({"messages": _user({"type": "tool_use", "id": "t", "name": "f", "input": {}})}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}, "messages.1.content.0"),
    ({"messages": _user({"type": "text"})}, "messages.0.content.0.text"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
    ({"messages": []}, "messages"),
    ({"system": [{"type": "image"}]}, "system.0"),
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [WEATHER]}, "tools"),   # (tool_choice auto needs a tool-call parser: none here)
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"stop_sequences": [str(i) for i in range(33)]}, "stop_sequences"),
    ({"temperature": -1}, "temperature"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"model": "claude-sonnet-4-5"}, "model"),
]


@pytest.mark.parametrize("body,where", BAD)
def test_bad_requests_are_anthropic_4xx_and_the_engine_serves_on(smol_server, body, where):
    before = rejected(smol_server)
    full = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], **body}
    r = httpx.post(smol_server.url + "/v1/messages", json={k: v for k, v in full.items() if v is not None}, timeout=60)
    status, kind = (404, "not_found_error") if where == "model" else (400, "invalid_request_error")
    check_error(r, status, kind, where)
    assert rejected(smol_server) == before + 1   # (counted as the other endpoints' refusals are)
    if where != "max_tokens":          # (count_tokens takes the prompt's fields alone)
        prompt = {k: v for k, v in full.items() if k in M.CountTokensRequest.model_fields}
        c = httpx.post(smol_server.url + "/v1/messages/count_tokens", json=prompt, timeout=60)
        if where in ("tools", "stop_sequences", "temperature"):   # (tool_choice auto needs no parser to count)
            assert c.status_code == 200, c.text
        else:
            check_error(c, status, kind, where)
    assert wait_idle(smol_server)["blitz_kv_cache_usage_perc"] == 0
    assert create(smol_server, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]).usage.output_tokens


def test_errors_in_anthropic_shape_everywhere_under_v1_messages(smol_server):
    """The SDK reads them; malformed JSON, unknown routes and methods take the shape too, the
    OpenAI routes keep theirs."""
    url = smol_server.url
    with pytest.raises(anthropic.BadRequestError) as e:
        sdk(smol_server).messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "data": "x"}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and e.value.status_code == 400
    with pytest.raises(anthropic.NotFoundError):
        create(smol_server, model="claude-opus-4", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    check_error(httpx.post(url + "/v1/messages", content=b"{"), 400, "invalid_request_error")
    check_error(httpx.post(url + "/v1/messages/nope", json={}), 404, "not_found_error")
    check_error(httpx.get(url + "/v1/messages"), 405, "invalid_request_error")
    assert set(httpx.post(url + "/v1/chat/completions", content=b"{").json()) == {"error"}


def test_disconnect_mid_stream_frees_blocks(smol_server):
    body = {"model": MODEL, "max_tokens": 900, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    drop_stream_midway(smol_server, "/v1/messages", body, lambda line: line == "event: content_block_delta")
    assert create(smol_server, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]).content


# ---- the tiny server: an API key, a 1024-token context ------------------------------------------
def test_x_api_key_or_bearer(tiny_server):
    url, hi = tiny_server.url, {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}, {"x-api-key": ""}):
            err = check_error(httpx.post(url + path, json=hi, headers=headers, timeout=30), 401,
                              "authentication_error")
            assert "x-api-key" in err["message"]
        for headers in ({"x-api-key": "sesame", "anthropic-version": "2023-06-01"}, {"Authorization": "Bearer sesame"}):
            assert httpx.post(url + path, json=hi, headers=headers, timeout=60).status_code == 200
    keyed = anthropic.Anthropic(base_url=url, api_key=None, auth_token=None, default_headers={"x-api-key": "sesame"},
                                max_retries=0, timeout=60)
    assert keyed.messages.create(model="tiny", max_tokens=2, messages=hi["messages"]).usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.count_tokens(
            model="tiny", messages=hi["messages"])
    chat_body = {"model": "tiny", "max_tokens": 1, "messages": hi["messages"]}
    assert httpx.post(url + "/v1/chat/completions", json=chat_body, headers={"x-api-key": "sesame"},
                      timeout=60).status_code == 200   # (one key, either header, on every route)


def test_max_tokens_past_the_context_is_lowered(tiny_server):
    """As Anthropic and vLLM do: the output may run to the context's end, and stops there with
    model_context_window_exceeded (max_tokens when the request's own bound ends it)."""
    c = sdk(tiny_server)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], extra_body={**GREEDY, "ignore_eos": True})
    n_in = c.messages.count_tokens(model="tiny", messages=kw["messages"]).input_tokens
    got = c.messages.create(max_tokens=32000, **kw)
    assert (got.stop_reason, got.usage.output_tokens, prompt_tokens(got.usage)) == \
        ("model_context_window_exceeded", 1024 - n_in, n_in)
    fits = c.messages.create(max_tokens=1024 - n_in, **kw)
    assert (fits.stop_reason, fits.usage.output_tokens) == ("max_tokens", 1024 - n_in)


def test_min_tokens_past_the_lowered_max_tokens_is_a_400(tiny_server):
    """max_tokens past the context is lowered to what fits; a min_tokens (vLLM's extra) past that
    lowered bound is the client's error, an Anthropic-shaped 400 naming min_tokens (it was a 500:
    SamplingParams refused the lowered copy), and the server goes on serving."""
    body = {"model": "tiny", "max_tokens": 32000, "min_tokens": 1020, "messages": [{"role": "user", "content": "Hi"}]}
    for stream in (False, True):
        r = httpx.post(tiny_server.url + "/v1/messages", json={**body, "stream": stream},
                       headers=tiny_server.headers(), timeout=60)
        assert r.status_code == 400, r.text
        err = M.AnthropicError.model_validate(r.json())
        assert err.error.type == "invalid_request_error" and "min_tokens" in err.error.message
    ok = sdk(tiny_server).messages.create(model="tiny", max_tokens=32000, messages=body["messages"],
                                          extra_body={**GREEDY, "min_tokens": 4})
    assert ok.usage.output_tokens >= 4


# ---- thinking blocks (the tiny thinking model) -------------------------------------------------
def test_thinking_blocks(thinking_server):
    """The prompt opens <think>, which the random model never closes: its whole answer is one
    thinking block (the raw text of /v1/completions for the same prompt); streamed as
    thinking_delta events. thinking disabled renders the template without it: a text block."""
    c = sdk(thinking_server)
    turns = [{"role": "user", "content": "Why is the sky blue?"}]
    ids = httpx.post(thinking_server.url + "/tokenize", json={"messages": turns}, timeout=30).json()["tokens"]
    raw = httpx.post(thinking_server.url + "/v1/completions", json={"prompt": ids, "max_tokens": 12, **GREEDY},
                     timeout=60).json()
    kw = dict(model="think", max_tokens=12, messages=turns, extra_body=GREEDY)
    got = c.messages.create(**kw)
    [block] = got.content
    assert (block.type, block.thinking, block.signature) == ("thinking", raw["choices"][0]["text"], "")
    assert got.usage.output_tokens == raw["usage"]["completion_tokens"]
    assert got.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[raw["choices"][0]["finish_reason"]]
    with c.messages.stream(**kw) as st:
        events = list(st)
        final = st.get_final_message()
    thought = "".join(e.delta.thinking for e in events if e.type == "content_block_delta")
    assert thought == block.thinking and same(final) == same(got)
    assert c.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 2048}).content == got.content
    off = c.messages.create(**kw, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]
    assert prompt_tokens(off.usage) == tokens_of(thinking_server, messages=turns,
                                                 chat_template_kwargs={"enable_thinking": False})
    # a thinking block in the input is the assistant turn's reasoning_content (this template does
    # not render it: the prompt is the one without it) and its text the turn's content
    again = c.messages.create(model="think", max_tokens=2, extra_body=GREEDY, messages=turns + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": block.thinking, "signature": ""},
                                          {"type": "redacted_thinking", "data": "xyz"},
                                          {"type": "text", "text": "Rayleigh."}]},
        {"role": "user", "content": "Sure?"}])
    assert prompt_tokens(again.usage) == tokens_of(thinking_server, messages=turns + [
        {"role": "assistant", "content": "Rayleigh."}, {"role": "user", "content": "Sure?"}])


# ---- without a server: the conversion and the content builder -----------------------------------
def _conversation(**body):
    from blitzllm.server.messages_items import Conversation
    return Conversation(M.MessagesRequest.model_validate({"model": "m", "max_tokens": 1, **body}))


def test_conversation_in_chat_terms():
    """Tool results become tool messages in their place among the user's text; consecutive
    assistant messages make one turn (thinking, text, calls); tools, choices and thinking as
    chat's."""
    conv = _conversation(
        system=[{"type": "text", "text": "x-anthropic-billing-header: h"}, {"type": "text", "text": "S"}],
        messages=[{"role": "user", "content": "Q"},
                  {"role": "assistant", "content": [{"type": "thinking", "thinking": "T", "signature": "s"},
                                                    {"type": "text", "text": "A"}]},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f",
                                                     "input": {"x": "é"}}]},
                  {"role": "user", "content": [{"type": "text", "text": "before"},
                                               {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                                                   {"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
                                               {"type": "text", "text": "after"}, {"type": "text", "text": "more"}]}],
        tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        thinking={"type": "disabled"}, chat_template_kwargs={"thinking": True})
    assert [m.model_dump(exclude_none=True) for m in conv.messages] == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A", "reasoning_content": "T", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"x": "é"}'}}]},
        {"role": "user", "content": "before"}, {"role": "tool", "tool_call_id": "toolu_1", "content": "r1\nr2"},
        {"role": "user", "content": "after\nmore"}]
    assert conv.end == {"add_generation_prompt": True, "continue_final_message": False}
    assert conv.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}}]
    assert (conv.tool_choice, conv.parallel) == ("required", False)
    assert conv.template_kwargs == {"thinking": True, "enable_thinking": False}   # (the request's own kwargs win)
    prefill = _conversation(messages=[{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
                            tools=[WEATHER], tool_choice={"type": "none"})
    assert prefill.end == {"add_generation_prompt": False, "continue_final_message": True}
    assert prefill.tool_choice == "none" and prefill.prompt_tools() is None
    assert _conversation(messages=[{"role": "user", "content": "Q"}], tool_choice={"type": "auto"}).tool_choice is None


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.mark.parametrize("text,want", [
    ("Paris.", [{"type": "text", "text": "Paris."}]),
    ("\n" + CALL + "\n", [("tool_use", "get_weather", {"city": "Paris"})]),   # (whitespace: no text block)
    ("Let me check.\n" + CALL, [{"type": "text", "text": "Let me check.\n"},
                                ("tool_use", "get_weather", {"city": "Paris"})]),
    ("", []),
])
def test_builder_blocks_in_every_chunking(text, want):
    """The same blocks however the text is cut into events; the events build them as the SDK's
    stream accumulation does."""
    from types import SimpleNamespace

    from anthropic.lib.streaming._messages import accumulate_event

    from blitzllm.server.chat import ChoiceParser
    from blitzllm.server.messages_items import ContentBuilder
    from blitzllm.server.tools import ToolCallSplitter
    for cut in [[]] + [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]:
        pieces = [text[a:b] for a, b in zip([0] + cut, cut + [len(text)])]
        b = ContentBuilder(ChoiceParser(None, ToolCallSplitter()))
        events = []
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            events += b.feed(SimpleNamespace(text=piece, new_token_ids=[i], logprobs=None, stop_reason=None,
                                             finish_reason="stop" if last else None,
                                             num_cached_tokens=0 if last else None))
        got = [x if x["type"] == "text" else (x["type"], x["name"], x["input"]) for x in b.content]
        assert got == want, cut
        assert b.stop(10)["stop_reason"] == ("tool_use" if CALL in text else "end_turn")
        snapshot, bufs = None, {}
        start = {"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
                                                      "model": "m", "content": [], "usage": b.usage(5)}}
        for e in [start] + events + [{"type": "message_delta", "delta": b.stop(10), "usage": b.usage(5)}]:
            snapshot = accumulate_event(event=e, current_snapshot=snapshot, json_bufs=bufs)
        assert [block.to_dict() for block in snapshot.content] == b.content
