"""POST /v1/responses (OpenAI's Responses API) on a real ``blitz serve`` of SmolLM2, through the
official ``openai`` client: answers equal what /v1/chat/completions gives for the same
conversation (greedy), streamed ones equal the whole ones, forced tool calls and their outputs
round trip, json_schema text formats parse, ``previous_response_id`` equals sending the whole
conversation, stored responses are read and deleted, bad requests are 4xx that leave the engine
serving and a dropped stream frees its KV blocks. A tiny thinking model (conftest's
``thinking_server``, ``--reasoning-parser qwen3``) gives reasoning items. The output builder
and the store are tested without a server at the end."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response

from blitzllm.server import responses_protocol as R
from tests.conftest import needs_xgrammar
from tests.server.server_helpers import (check_error, client, drop_stream_midway, rejected, same, tokens_of,
                                         wait_idle)

MODEL = "smollm2"
ASK = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"],
    "additionalProperties": False}}


def _chat_tool(t: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}


def chat(srv, messages, **body) -> dict:
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                            "temperature": 0, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def raw_response(srv, **body) -> dict:
    """A response's JSON as the server sends it, checked against the SDK's type and the documented model."""
    r = httpx.post(srv.url + "/v1/responses", json={"model": MODEL, "temperature": 0, **body},
                   headers=srv.headers(), timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    Response.model_validate(body)        # (every field the SDK requires, of its type)
    R.ResponseObject.model_validate(body)  # (and nothing undocumented)
    return body



def test_string_input_equals_chat(smol_server):
    """One user message: the text, the token counts and the finish equal chat's; the body is the
    SDK's Response with the request's settings echoed."""
    want = chat(smol_server, [{"role": "user", "content": ASK}], max_tokens=24)
    body = raw_response(smol_server, input=ASK, max_output_tokens=24, metadata={"k": "v"}, user="u1")
    assert body["id"].startswith("resp_") and body["object"] == "response" and body["model"] == MODEL
    [msg] = body["output"]
    assert msg["type"] == "message" and msg["role"] == "assistant" and msg["id"].startswith("msg_")
    assert [p["type"] for p in msg["content"]] == ["output_text"]
    assert msg["content"][0]["text"] == want["choices"][0]["message"]["content"] and "Paris" in msg["content"][0]["text"]
    finish = want["choices"][0]["finish_reason"]
    assert body["status"] == ("completed" if finish == "stop" else "incomplete") == msg["status"]
    u = body["usage"]
    assert (u["input_tokens"], u["output_tokens"]) == (want["usage"]["prompt_tokens"],
                                                       want["usage"]["completion_tokens"])
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    assert u["output_tokens_details"]["reasoning_tokens"] == 0
    assert 0 < u["input_tokens_details"]["cached_tokens"] < u["input_tokens"]  # (chat just ran this prompt)
    assert (body["max_output_tokens"], body["temperature"], body["top_p"], body["metadata"], body["user"],
            body["tool_choice"], body["tools"], body["text"], body["store"], body["parallel_tool_calls"]) == \
        (24, 0, 1, {"k": "v"}, "u1", "auto", [], {"format": {"type": "text"}}, True, True)
    assert client(smol_server).responses.create(model=MODEL, input=ASK, max_output_tokens=24,
                                                temperature=0).output_text == msg["content"][0]["text"]


def test_items_and_instructions_equal_chat(smol_server):
    """Instructions become the first (system) message; message items of every role, content as a
    string or as text parts, and an earlier answer's output message, as chat's messages."""
    history = [{"role": "user", "content": "My name is Bob."},
               {"role": "assistant", "content": "Hello Bob!"},
               {"role": "user", "content": "What is my name?"}]
    want = chat(smol_server, [{"role": "system", "content": "Answer in one word."}] + history, max_tokens=12)
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "My name is Bob."}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Hello Bob!", "annotations": []}]},
             {"role": "user", "content": "What is my name?"}]
    r = client(smol_server).responses.create(model=MODEL, input=items, instructions="Answer in one word.",
                                             max_output_tokens=12, temperature=0)
    assert r.output_text == want["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert r.instructions == "Answer in one word."
    plain = client(smol_server).responses.create(model=MODEL, input=items, max_output_tokens=12, temperature=0)
    assert plain.usage.input_tokens == tokens_of(smol_server, messages=history) != r.usage.input_tokens


def test_max_output_tokens_is_incomplete(smol_server):
    c = client(smol_server)
    r = c.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    want = chat(smol_server, [{"role": "user", "content": "Tell me a long story."}], max_tokens=3)
    assert r.output_text == want["choices"][0]["message"]["content"]
    events = list(c.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3,
                                     temperature=0, stream=True))
    assert events[-1].type == "response.incomplete" and "response.completed" not in [e.type for e in events]
    assert same(events[-1].response) == same(r)


def _check_sequence(events: list) -> None:
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_stream_equals_non_stream(smol_server):
    """client.responses.stream: the SDK's event sequence, deltas adding up to the text, and a
    final response equal to the non-streaming one."""
    c = client(smol_server)
    kw = dict(model=MODEL, input=ASK, max_output_tokens=40, temperature=0)
    whole = c.responses.create(**kw)
    assert whole.status == "completed"   # (SmolLM2 answers in fewer tokens)
    with c.responses.stream(**kw) as st:
        events = list(st)
        final = st.get_final_response()
    _check_sequence(events)
    types = [e.type for e in events]
    n = types.count("response.output_text.delta")
    assert n >= 3 and types == ["response.created", "response.in_progress", "response.output_item.added",
                                "response.content_part.added"] + ["response.output_text.delta"] * n + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id")) and final.output[0].id == item_id
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == final.output_text == whole.output_text
    assert same(final) == same(whole)
    assert final.id == events[0].response.id != whole.id


def test_logprobs(smol_server):
    """include message.output_text.logprobs: one entry per token of the text, top_logprobs
    sorted (greedy: the chosen token first); streamed deltas carry the same."""
    c = client(smol_server)
    kw = dict(model=MODEL, input=ASK, max_output_tokens=6, temperature=0, top_logprobs=2,
              include=["message.output_text.logprobs"])
    r = c.responses.create(**kw)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens == 6 and "".join(lp.token for lp in lps) == r.output_text
    for lp in lps:
        assert [t.token for t in lp.top_logprobs][0] == lp.token and len(lp.top_logprobs) == 2
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob and lp.bytes == list(lp.token.encode())
    streamed = [lp for e in c.responses.create(**kw, stream=True) if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in lps]
    assert c.responses.create(**{**kw, "include": None}).output[0].content[0].logprobs == []


@needs_xgrammar
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_tool_calls_equal_chat(smol_server, choice):
    """A forced tool choice decodes the call by a grammar (no tool-call parser on this server):
    function_call items equal to chat's tool_calls, streamed as argument events."""
    c = client(smol_server)
    chat_choice = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice["name"]}}
    want = chat(smol_server, [{"role": "user", "content": "What is the weather in Paris?"}], max_tokens=60,
                tools=[_chat_tool(WEATHER), _chat_tool(TIME)], tool_choice=chat_choice)["choices"][0]["message"]
    kw = dict(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER, TIME], tool_choice=choice,
              max_output_tokens=60, temperature=0)
    r = c.responses.create(**kw)
    assert r.status == "completed" and all(o.type == "function_call" for o in r.output)
    assert [(o.name, o.arguments) for o in r.output] == \
        [(t["function"]["name"], t["function"]["arguments"]) for t in want["tool_calls"]]
    assert all(o.call_id.startswith("call_") and o.id.startswith("fc_") and o.status == "completed" for o in r.output)
    assert r.tool_choice == choice if isinstance(choice, str) else r.tool_choice.name == "get_weather"
    with c.responses.stream(**kw) as st:
        events = list(st)
        final = st.get_final_response()
    _check_sequence(events)
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in args] == [o.arguments for o in r.output]
    assert "response.output_text.delta" not in [e.type for e in events]
    assert same(final) == same(r)
    one = c.responses.create(**{**kw, "tool_choice": "required"}, parallel_tool_calls=False)
    assert len(one.output) == 1 and one.parallel_tool_calls is False


@needs_xgrammar
def test_function_call_output_round_trip(smol_server):
    """An answer's function_call item and the caller's function_call_output go back as the chat
    template's assistant tool call and tool message: the prompt and answer equal chat's."""
    c = client(smol_server)
    r = c.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                           tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                           temperature=0)
    call = r.output[0]
    items = [{"role": "user", "content": "What is the weather in Paris?"}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}]
    answer = c.responses.create(model=MODEL, input=items, max_output_tokens=30, temperature=0)
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "18 C and sunny"}]
    want = chat(smol_server, messages, max_tokens=30)
    assert answer.usage.input_tokens == want["usage"]["prompt_tokens"] == tokens_of(smol_server, messages=messages)
    assert answer.output_text == want["choices"][0]["message"]["content"]
    without = tokens_of(smol_server, messages=messages[:2] + [{**messages[2], "content": ""}])
    assert without < answer.usage.input_tokens   # (the output reached the prompt)


@needs_xgrammar
def test_json_schema_text_format(smol_server):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client(smol_server).responses.create(
        model=MODEL, input="Describe a person as JSON.", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}})
    obj = json.loads(r.output_text)
    assert list(obj) == ["name", "age"] and isinstance(obj["age"], int) and r.status == "completed"
    want = chat(smol_server, [{"role": "user", "content": "Describe a person as JSON."}], max_tokens=60,
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert r.output_text == want["choices"][0]["message"]["content"]
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"


def test_previous_response_id_equals_the_whole_conversation(smol_server):
    """previous_response_id puts the earlier input and output before the new input; the earlier
    instructions are not carried over (OpenAI's rule)."""
    c = client(smol_server)
    first = c.responses.create(model=MODEL, input="My name is Bob.", instructions="You are a pirate.",
                               max_output_tokens=16, temperature=0)
    then = c.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                              max_output_tokens=16, temperature=0)
    whole = c.responses.create(model=MODEL, input=[{"role": "user", "content": "My name is Bob."},
                                                   *[o.model_dump(exclude_none=True) for o in first.output],
                                                   {"role": "user", "content": "What is my name?"}],
                               max_output_tokens=16, temperature=0)
    assert then.previous_response_id == first.id
    assert (then.output_text, then.usage.input_tokens) == (whole.output_text, whole.usage.input_tokens)
    assert then.usage.input_tokens_details.cached_tokens > 0   # (the earlier turn's prompt was cached)
    third = c.responses.create(model=MODEL, input="And again?", previous_response_id=then.id, max_output_tokens=8,
                               temperature=0)
    assert third.usage.input_tokens > then.usage.input_tokens + then.usage.output_tokens


def test_stored_responses_get_delete_and_404s(smol_server):
    c, url = client(smol_server), smol_server.url
    r = c.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
    assert r.store is True and same(c.responses.retrieve(r.id)) == same(r)
    assert c.responses.retrieve(r.id).id == r.id
    err = check_error(httpx.post(f"{url}/v1/responses/{r.id}/cancel"), 400, "response_id")
    assert "background" in err["message"]
    d = httpx.delete(f"{url}/v1/responses/{r.id}")
    assert d.status_code == 200 and d.json() == {"id": r.id, "object": "response", "deleted": True}
    R.DeletedResponse.model_validate(d.json())
    for call in (lambda: c.responses.retrieve(r.id), lambda: c.responses.delete(r.id),
                 lambda: c.responses.cancel(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["param"] == "response_id" and e.value.body["code"] == "response_not_found"
    check_error(httpx.post(url + "/v1/responses", json={"input": "Hi", "previous_response_id": r.id}), 404,
                "previous_response_id")
    unstored = c.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    check_error(httpx.get(f"{url}/v1/responses/{unstored.id}"), 404, "response_id")


BAD = [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tools": [WEATHER]}, "tools"),   # (tool_choice auto needs a tool-call parser: none here)
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a+"}}, "text.format"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "name": "f"}]}, "input.1.call_id"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.role"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"max_output_tokens": "8"}, "max_output_tokens"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"include": ["everything"]}, "include.0"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"temperature": -1}, "temperature"),
    ({"model": "gpt-4o"}, "model"),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_requests_are_4xx_and_the_engine_serves_on(smol_server, body, param):
    before = rejected(smol_server)
    r = httpx.post(smol_server.url + "/v1/responses", json={"model": MODEL, "input": "Hi", **body}, timeout=60)
    check_error(r, 404 if param == "model" else 400, param)
    assert rejected(smol_server) == before + 1   # (counted as the other endpoints' refusals are)
    assert wait_idle(smol_server)["blitz_kv_cache_usage_perc"] == 0
    assert client(smol_server).responses.create(model=MODEL, input="Hi", max_output_tokens=2).usage.output_tokens


def test_unknown_fields_are_ignored(smol_server):
    """As the chat request does (OpenAI clients send extras): prompt_cache_key, service_tier..."""
    body = raw_response(smol_server, input=ASK, max_output_tokens=4, prompt_cache_key="k", service_tier="auto",
                        some_future_field={"x": 1}, truncation="auto", reasoning={"effort": "low"})
    assert body["truncation"] == "auto" and body["reasoning"] == {"effort": "low"}


def test_disconnect_mid_stream_frees_blocks(smol_server):
    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 900, "ignore_eos": True,
            "stream": True}
    drop_stream_midway(smol_server, "/v1/responses", body,
                       lambda line: line.startswith("data:") and '"response.output_text.delta"' in line)
    assert client(smol_server).responses.create(model=MODEL, input="Hi", max_output_tokens=2).output_text is not None


def test_api_key_guards_every_route(tiny_server):
    url = tiny_server.url
    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"),
                         ("DELETE", "/v1/responses/resp_x"), ("POST", "/v1/responses/resp_x/cancel")):
        check_error(httpx.request(method, url + path, json={"input": "Hi"}, timeout=30), 401, None)
    r = client(tiny_server).responses.create(model="tiny", input="Hi", max_output_tokens=2)
    assert client(tiny_server).responses.retrieve(r.id).id == r.id


# ---- reasoning items (the tiny thinking model) -------------------------------------------------
def test_reasoning_items(thinking_server):
    """The prompt opens <think>, which the random model never closes: its whole answer is one
    reasoning item (the raw text of /v1/completions for the same prompt), counted as reasoning
    tokens; streamed as reasoning_text events. With thinking off, a message and no reasoning."""
    c = client(thinking_server)
    msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    ids = httpx.post(thinking_server.url + "/tokenize", json={"messages": msgs}, timeout=30).json()["tokens"]
    raw = httpx.post(thinking_server.url + "/v1/completions", json={"prompt": ids, "max_tokens": 12,
                                                                   "temperature": 0}, timeout=60).json()
    kw = dict(model="think", input="Why is the sky blue?", max_output_tokens=12, temperature=0)
    r = c.responses.create(**kw)
    [item] = r.output
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.summary == []
    assert [p.text for p in item.content] == [raw["choices"][0]["text"]] and r.output_text == ""
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == \
        raw["usage"]["completion_tokens"]
    events = list(c.responses.create(**kw, stream=True))   # (cut short: response.incomplete ends it)
    _check_sequence(events)
    assert events[-1].type == f"response.{r.status}"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == item.content[0].text
    assert same(events[-1].response) == same(r)
    off = c.responses.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [o.type for o in off.output] == ["message"] and off.usage.output_tokens_details.reasoning_tokens == 0
    # a reasoning item in the input is the assistant turn's reasoning_content (this template does
    # not render it: the prompt is the one without it) and its message the turn's content
    again = c.responses.create(model="think", input=[{"role": "user", "content": "Why is the sky blue?"},
                                                     item.model_dump(exclude_none=True),
                                                     {"role": "assistant", "content": "Rayleigh."},
                                                     {"role": "user", "content": "Sure?"}],
                               max_output_tokens=2, temperature=0)
    assert again.usage.input_tokens == tokens_of(thinking_server, messages=msgs + [
        {"role": "assistant", "content": "Rayleigh."}, {"role": "user", "content": "Sure?"}])


# ---- without a server: the output builder and the store ----------------------------------------
def _built(text: str, cut: list, reasoning_opened=None, forced=None) -> tuple:
    """(output items, events) of ``text`` fed as engine events cut at ``cut``, through the chat
    parsers a hermes tool-call server (and a qwen3 reasoning parser where ``reasoning_opened`` is
    not None) would use."""
    from types import SimpleNamespace

    from blitzllm.server.chat import ChoiceParser
    from blitzllm.server.reasoning import ThinkSplitter
    from blitzllm.server.responses_items import OutputBuilder
    from blitzllm.server.tools import ToolCallSplitter
    pieces = [text[a:b] for a, b in zip([0] + cut, cut + [len(text)])]
    tools = forced.splitter() if forced else ToolCallSplitter()
    b = OutputBuilder(None, ChoiceParser(None if reasoning_opened is None else ThinkSplitter(reasoning_opened),
                                         tools, forced=forced is not None), None)
    events = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        events += b.feed(SimpleNamespace(text=piece, new_token_ids=[i], logprobs=None, stop_reason=None,
                                         finish_reason="stop" if last else None, num_cached_tokens=0 if last else None))
    return b.items, events


def _kinds(items) -> list:
    return [(o["type"], o["content"][0]["text"] if o["type"] != "function_call" else (o["name"], o["arguments"]))
            for o in items]


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.mark.parametrize("text,want", [
    ("Paris.", [("message", "Paris.")]),
    ("\n" + CALL + "\n", [("function_call", ("get_weather", '{"city": "Paris"}'))]),   # (whitespace: no message)
    ("Let me check.\n" + CALL, [("message", "Let me check.\n"), ("function_call", ("get_weather", '{"city": "Paris"}'))]),
    ("  ", [("message", "  ")]),
    ("", [("message", "")]),
])
def test_builder_items_equal_chat_in_every_chunking(text, want):
    """Content and calls as chat's whole-output parse (split_tool_calls) gives them, however the
    text is cut into events; the events' deltas add up to the items."""
    from blitzllm.server.tools import split_tool_calls
    content, calls = split_tool_calls(text)
    assert [x for x in want if x[0] == "message"] == ([("message", content)] if content is not None else [])
    assert [x[1] for x in want if x[0] == "function_call"] == [(c["function"]["name"], c["function"]["arguments"])
                                                              for c in calls]
    for cut in [[]] + [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]:
        items, events = _built(text, cut)
        assert _kinds(items) == want, cut
        assert "".join(e.get("delta", "") for e in events if e["type"] == "response.output_text.delta") == \
            "".join(t for k, t in want if k == "message")
        assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == items
        added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
        assert added == list(range(len(items)))


def test_builder_reasoning_then_message():
    items, events = _built("step one</think>\n\nParis", [3, 9, 15, 17], reasoning_opened=True)
    assert _kinds(items) == [("reasoning", "step one"), ("message", "\n\nParis")]
    assert items[0]["summary"] == [] and items[0]["content"][0]["type"] == "reasoning_text"
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")


def test_store_is_bounded_lru():
    from blitzllm.server.responses_store import ResponseStore
    store = ResponseStore(2, max_chars=10_000)
    for i in range(3):
        assert store.put(f"r{i}", store.entry({"id": f"r{i}"}, None, [{"n": i}]))
    assert store.get("r0") is None and len(store) == 2
    earlier = store.get("r2")
    store.get("r1")                        # (read: now the most recently used)
    store.put("r3", store.entry({"id": "r3"}, earlier, [{"n": 3}]))
    assert store.get("r1") is not None and store.get("r2") is None and len(store) == 2
    assert store.get("r3").conversation == [{"n": 2}, {"n": 3}]   # (r2's turn lives on in r3's conversation)
    assert not store.put("big", store.entry({"id": "big"}, None, [{"x": "y" * 20_000}]))
    small = ResponseStore(5, max_chars=100)
    small.put("a", small.entry({"id": "a"}, None, [{"x": "y" * 40}]))
    small.put("b", small.entry({"id": "b"}, None, [{"x": "y" * 40}]))
    assert small.get("a") is None and small.get("b") is not None     # (the size budget dropped the oldest)
    assert not ResponseStore(0).put("a", small.entry({"id": "a"}, None, []))
    assert store.delete("r3") and not store.delete("r3")


def test_max_stored_responses_flag():
    from blitzllm.cli import build_parser
    from blitzllm.server.app import config_from_args
    assert config_from_args(build_parser().parse_args(["serve", "--max-stored-responses", "7"])).max_stored_responses == 7
    with pytest.raises(ValueError, match="max-stored-responses"):
        config_from_args(build_parser().parse_args(["serve", "--max-stored-responses", "-1"]))
