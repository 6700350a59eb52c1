"""``blitz serve`` on a tiny random Qwen3.5 (``Qwen3_5ForCausalLM``, a ``qwen3_5_text``
checkpoint written by save_pretrained) with a tokenizer and a chat template in the format of
Qwen3.5's published one, served as a Qwen3.5 is: ``--reasoning-parser qwen3
--enable-auto-tool-choice --tool-call-parser qwen3_coder`` (issue 34, acceptance 3).

Checked on the real server: plain chat; the think block the template opens comes back as
reasoning_content, equal to the raw text /v1/completions gives for the same prompt (and as
content with ``enable_thinking: false``); the tools reach the system turn; earlier calls and
tool results render in Qwen3.5's form; a Qwen3.5 tool-call block in the answer comes back as
typed tool_calls (the random model writes none by itself, so a regex makes it write one);
``tool_choice`` required / named are forced through structured output; bad requests are
400s and the engine keeps serving. With thinking on, a forced choice's grammar starts after
</think>, and an earlier turn's reasoning_content reaches the template."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.conftest import needs_xgrammar
from tests.server.conftest import ServerProcess, running
from tests.server.server_helpers import check_error, stream_chat

# Written for this test in the format of Qwen/Qwen3.5's published chat_template.jinja (the
# Qwen3.5 tokenizer_config's template, also what vLLM's qwen3_coder parser reads): the tools
# listed as JSON in <tools> in the system turn with the <tool_call> <function=...>
# <parameter=...> instructions, the system prompt after them; earlier calls rendered in that
# form (mapping / list values as JSON, others as strings); tool results as <tool_response>
# blocks in one user turn; reasoning_content of the turns after the last user query in a
# <think> block; the generation prompt opening <think> (closing an empty one with
# enable_thinking false). The prose of the instructions is shortened and the vision parts
# left out (this is the text model).
QWEN35_TEMPLATE = r"""
{%- if not messages %}{{- raise_exception('No messages provided.') }}{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n' }}
    {{- '<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n' }}
    {{- '</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Nest one <function=...></function> block in each '
        '<tool_call></tool_call>\n- Give the required parameters\n</IMPORTANT>' }}
    {%- if messages[0].role == 'system' and messages[0].content | trim %}
        {{- '\n\n' + messages[0].content | trim }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content | trim + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' %}
        {%- set text = message.content | trim %}
        {%- if not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}{{- raise_exception('No user query found in messages.') }}{%- endif %}
{%- for message in messages %}
    {%- set content = message.content | trim %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{- raise_exception('System message must be at the beginning.') }}{%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning | trim + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for call in message.tool_calls %}
                {%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
                {%- if not loop.first %}{{- '\n' }}{%- elif content | trim %}{{- '\n\n' }}{%- endif %}
                {{- '<tool_call>\n<function=' + call.name + '>\n' }}
                {%- if call.arguments is defined %}
                    {%- for name, value in call.arguments | items %}
                        {{- '<parameter=' + name + '>\n' }}
                        {%- if value is mapping or (value is sequence and value is not string) %}
                            {{- value | tojson | safe }}
                        {%- else %}
                            {{- value | string }}
                        {%- endif %}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
""".strip()

SEED = 1  # (a model whose forced "required" array ends well within max_tokens)
# the tags Qwen3.5's tokenizer has as added (not special) tokens, so they show in decoded text
QWEN35_TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def _tiny_qwen35(folder):
    """A 4-layer random Qwen3.5 (GDN, attention, GDN, attention) with SmolLM2's tokenizer
    (ChatML's <|im_start|> / <|im_end|>, as Qwen's) plus Qwen3.5's tags, and the template
    above as the folder's chat_template.jinja, as Qwen3.5's folders keep it."""
    from blitzllm.loader.source import smollm2_path
    from blitzllm.loader.tokenizer import load_gguf_tokenizer
    import torch
    from tests.models.test_qwen3_next import make_hybrid_checkpoint
    tok = load_gguf_tokenizer(smollm2_path())
    tok.add_tokens(QWEN35_TAGS)
    hf = make_hybrid_checkpoint("qwen3_5_text", folder, seed=SEED, vocab_size=len(tok), max_position_embeddings=2048,
                                eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    # A trained model ends its JSON; this random one would pad a forced call with the whitespace
    # JSON allows without bound. So the tokens that decode to whitespace only get a large negative
    # logit: every embedding carries a constant in hidden dim 0, which no layer writes to (their
    # output projections' row 0 zeroed), so the final norm leaves it positive, and only those
    # tokens' lm_head rows read it.
    space = [i for i in range(len(tok)) if not tok.decode([i]).strip() and i not in tok.all_special_ids]
    with torch.no_grad():
        hf.model.embed_tokens.weight[:, 0] = 1.0
        for name, w in hf.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                w[0] = 0.0
        hf.model.norm.weight[0] = 0.0
        hf.lm_head.weight[:, 0] = 0.0
        hf.lm_head.weight[space, 0] = -100.0
    hf.save_pretrained(str(folder), safe_serialization=True)
    tok.chat_template = QWEN35_TEMPLATE
    tok.save_pretrained(str(folder))
    assert (folder / "chat_template.jinja").read_text() == QWEN35_TEMPLATE
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3_5ForCausalLM"]
    return folder


@pytest.fixture(scope="module")
def qwen35_server(tmp_path_factory):
    folder = _tiny_qwen35(tmp_path_factory.mktemp("tiny-qwen35"))
    srv = ServerProcess(["--model", str(folder), "--served-model-name", "qwen35", "--reasoning-parser", "qwen3",
                         "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
                         "--max-model-len", "1024", "--kv-cache-blocks", "256", "--seed", "0"],
                        tmp_path_factory.mktemp("qwen35") / "server.log")
    yield from running(srv)
    assert srv.proc.returncode == 0, f"SIGTERM should stop the server cleanly:\n{srv.log()}"


# (enums, so that a forced answer of the random model ends: free strings would run to max_tokens)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city for some days",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]},
                                                    "days": {"type": "integer", "enum": [1, 2, 3]}},
                   "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a time zone",
        "parameters": {"type": "object",
                       "properties": {"timezone": {"type": "string", "enum": ["UTC", "Europe/Paris"]}},
                       "required": ["timezone"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


def _post(srv, path, body, status=200):
    r = httpx.post(srv.url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def _prompt_ids(srv, messages, tools=None, **template_kwargs) -> list:
    body = {"messages": messages, **({"tools": tools} if tools else {}),
            **({"chat_template_kwargs": template_kwargs} if template_kwargs else {})}
    return _post(srv, "/tokenize", body)["tokens"]


def _prompt_text(srv, messages, tools=None, **template_kwargs) -> str:
    ids = _prompt_ids(srv, messages, tools, **template_kwargs)
    return _post(srv, "/detokenize", {"tokens": ids})["prompt"]


def _raw(srv, ids, max_tokens=16) -> str:
    """The prompt's greedy text through /v1/completions (no parser there)."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    return _post(srv, "/v1/completions", body)["choices"][0]["text"]


def _chat(srv, messages, stream=False, max_tokens=16, **extra):
    """(message or the joined stream deltas, finish_reason); a stream's tool_calls listed."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}
    if not stream:
        choice = _post(srv, "/v1/chat/completions", body)["choices"][0]
        return choice["message"], choice["finish_reason"]
    parts, calls, reason = stream_chat(srv.url, body)
    return {**parts, "tool_calls": calls}, reason


def _args(calls) -> list:
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_served_as_qwen35(qwen35_server):
    models = httpx.get(qwen35_server.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == ["qwen35"]
    # the tags are single tokens, as in Qwen3.5's tokenizer
    ids = _post(qwen35_server, "/tokenize", {"prompt": "<think>\n</think><tool_call>", "add_special_tokens": False})
    assert ids["count"] == 4


def test_plain_chat(qwen35_server):
    """Thinking off (the template closes an empty block): the answer is content, the raw text
    of the same prompt; with no parser-visible block, nothing is reasoning."""
    ids = _prompt_ids(qwen35_server, ASK, enable_thinking=False)
    text = _post(qwen35_server, "/detokenize", {"tokens": ids})["prompt"]
    assert text == ("<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    raw = _raw(qwen35_server, ids)
    assert raw and "<think>" not in raw
    body = _post(qwen35_server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 16, "temperature": 0, **OFF})
    msg = body["choices"][0]["message"]
    assert body["model"] == "qwen35" and msg["role"] == "assistant"
    assert msg["content"] == raw and msg["reasoning_content"] is None
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] > 0
    assert _chat(qwen35_server, ASK, stream=True, **OFF) == (
        {"reasoning_content": "", "content": raw, "tool_calls": []}, body["choices"][0]["finish_reason"])


def test_thinking_comes_back_as_reasoning(qwen35_server):
    """Thinking on (Qwen3.5's default): the prompt opens <think>, so the random model's text,
    never closing it, is all reasoning_content, equal to /v1/completions' raw text."""
    ids = _prompt_ids(qwen35_server, ASK)
    assert _post(qwen35_server, "/detokenize", {"tokens": ids})["prompt"].endswith("<|im_start|>assistant\n<think>\n")
    raw = _raw(qwen35_server, ids)
    assert raw and "</think>" not in raw
    msg, reason = _chat(qwen35_server, ASK)
    assert msg["reasoning_content"] == raw and msg["content"] is None
    assert _chat(qwen35_server, ASK, stream=True) == ({"reasoning_content": raw, "content": "", "tool_calls": []},
                                                      reason)


@needs_xgrammar
@pytest.mark.parametrize("stream", [False, True])
def test_closed_think_block_splits_reasoning_from_content(qwen35_server, stream):
    """An answer that closes its think block (a regex writes one, as a trained model would):
    the block's text is reasoning_content, what follows is content."""
    msg, reason = _chat(qwen35_server, ASK, stream=stream, max_tokens=40,
                        structured_outputs={"regex": r"Paris is in France\.\n</think>\n\nSunny, 18 C\."})
    assert reason == "stop"
    assert msg["reasoning_content"] == "Paris is in France.\n" and msg["content"] == "\n\nSunny, 18 C."


def test_tools_reach_the_system_turn(qwen35_server):
    sys_msg = {"role": "system", "content": "You are terse."}
    text = _prompt_text(qwen35_server, [sys_msg, *ASK], tools=TOOLS)
    tools_json = "\n".join(json.dumps(t, ensure_ascii=False) for t in TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                           + tools_json + "\n</tools>\n\n")
    assert "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n" in text
    assert text.endswith("</IMPORTANT>\n\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is the weather in Paris?"
                         "<|im_end|>\n<|im_start|>assistant\n<think>\n")
    # auto: the random model writes no call, so its text comes back as before, nothing parsed away
    ids = _prompt_ids(qwen35_server, ASK, tools=TOOLS)
    msg, reason = _chat(qwen35_server, ASK, tools=TOOLS)
    assert "tool_calls" not in msg and reason in ("stop", "length")
    assert msg["reasoning_content"] == _raw(qwen35_server, ids)
    # tool_choice none leaves them out of the prompt
    assert _chat(qwen35_server, ASK, tools=TOOLS, tool_choice="none") == _chat(qwen35_server, ASK)


HISTORY = [
    {"role": "system", "content": "You are terse."},
    *ASK,
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
                    {"id": "call_2", "type": "function",
                     "function": {"name": "get_time", "arguments": '{"timezone": "Europe/Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
]


def test_earlier_tool_calls_and_results_render(qwen35_server):
    """The history's calls in Qwen3.5's XML form (the arguments string handed to the template
    as a mapping), both results in one user turn; the call turn, after the last user query,
    keeps a (here empty) think block."""
    text = _prompt_text(qwen35_server, HISTORY, tools=TOOLS)
    turns = text.split("</IMPORTANT>\n\nYou are terse.<|im_end|>\n", 1)[1]
    assert turns == (
        "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n<parameter=timezone>\nEurope/Paris\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n14:05\n</tool_response>"
        "<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")
    ids = _prompt_ids(qwen35_server, HISTORY, tools=TOOLS)
    msg, _ = _chat(qwen35_server, HISTORY, tools=TOOLS)
    assert msg["reasoning_content"] == _raw(qwen35_server, ids) and "tool_calls" not in msg
    # an earlier answer that wrote its own think block: the block is dropped before the last query
    two_turns = [*ASK, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nSunny."},
                 {"role": "user", "content": "And tomorrow?"}]
    assert "<|im_start|>assistant\nSunny.<|im_end|>\n<|im_start|>user\nAnd tomorrow?" in _prompt_text(
        qwen35_server, two_turns)


def test_earlier_reasoning_reaches_the_template(qwen35_server):
    """Interleaved thinking: the reasoning of a tool-call turn after the last user query is
    rendered back in its think block, as Qwen3.5's template does (an assistant message's
    reasoning_content goes to the template, as vLLM passes it); the chat endpoint renders the
    same prompt."""
    history = [dict(m) for m in HISTORY]
    history[2]["reasoning_content"] = "The user wants the weather."
    text = _prompt_text(qwen35_server, history, tools=TOOLS)
    assert "<|im_start|>assistant\n<think>\nThe user wants the weather.\n</think>\n\n<tool_call>" in text
    body = {"messages": history, "tools": TOOLS, "max_tokens": 1, "temperature": 0}
    assert _post(qwen35_server, "/v1/chat/completions", body)["usage"]["prompt_tokens"] == len(
        _prompt_ids(qwen35_server, history, tools=TOOLS))


# what a Qwen3.5 writes to call a tool (after its thinking), as its template asks
CALL_REGEX = (r"I need the weather\.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
              r"</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


@needs_xgrammar
@pytest.mark.parametrize("stream", [False, True])
def test_qwen35_tool_call_comes_back_as_tool_calls(qwen35_server, stream):
    """tool_choice auto: an answer holding a Qwen3.5 call block (a regex makes the random model
    write it) comes back through the qwen3_coder parser as tool_calls with the arguments typed
    by the tool's schema (days an integer), finish_reason tool_calls; the thinking before it
    is reasoning_content, and no content is left."""
    msg, reason = _chat(qwen35_server, ASK, stream=stream, max_tokens=240, tools=TOOLS,
                        structured_outputs={"regex": CALL_REGEX})
    assert reason == "tool_calls", msg
    assert _args(msg["tool_calls"]) == [("get_weather", {"city": "Paris", "days": 3})]
    assert msg["reasoning_content"] == "I need the weather.\n" and not (msg["content"] or "").strip()


def _forced(srv, choice, stream, **extra):
    msg, reason = _chat(srv, ASK, stream=stream, max_tokens=300, tools=TOOLS, tool_choice=choice, **extra)
    assert reason == "stop" and msg.get("tool_calls") and not msg["content"], (msg, reason)
    return _args(msg.get("tool_calls") or [])


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@needs_xgrammar
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_choices_with_thinking_off(qwen35_server, stream):
    """A named function and "required", forced through structured output (no parser needed):
    tool_calls of the asked shape, finish_reason stop."""
    calls = _forced(qwen35_server, NAMED, stream, **OFF)
    assert [n for n, _ in calls] == ["get_weather"] and "city" in calls[0][1]
    calls = _forced(qwen35_server, "required", stream, **OFF)
    for name, args in calls:
        assert name in ("get_weather", "get_time")
        assert "city" in args if name == "get_weather" else list(args) == ["timezone"]


# a logit_bias on </think> that makes the random model close its block after a few words (it
# would think to max_tokens otherwise); at +100 it closes the block at once
THINK_END_BIAS = 6.5


@needs_xgrammar
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_forced_tool_choices_with_thinking_on(qwen35_server, choice, stream):
    """Qwen3.5's default (thinking on, the prompt opens <think>) with a forced choice: the
    grammar applies only after </think> (vLLM's reasoning-aware structured outputs), so the
    thinking is free text in reasoning_content and the call comes back as tool_calls."""
    end = _post(qwen35_server, "/tokenize", {"prompt": "</think>", "add_special_tokens": False})["tokens"]
    assert len(end) == 1
    for bias in (THINK_END_BIAS, 100):
        msg, reason = _chat(qwen35_server, ASK, stream=stream, max_tokens=300, tools=TOOLS, tool_choice=choice,
                            logit_bias={str(end[0]): bias})
        assert reason == "stop" and msg.get("tool_calls") and not msg["content"], (msg, reason)
        names = [n for n, _ in _args(msg["tool_calls"])]
        assert names == ["get_weather"] if choice == NAMED else set(names) <= {"get_weather", "get_time"}
        reasoning = msg["reasoning_content"]
        if bias == 100:   # (closed at once: the grammar would have forbidden </think> as a first token)
            assert reasoning == "", msg
        else:             # free text, not the grammar's JSON
            assert len(reasoning.split()) >= 3 and "{" not in reasoning, msg


@pytest.mark.parametrize("body,status,param", [
    ({"messages": [{"role": "assistant", "content": "hi"}]}, 400, "messages"),  # the template: no user query
    ({"messages": [*ASK, {"role": "system", "content": "late"}]}, 400, "messages"),  # system not first
    ({"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     400, "tool_choice"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {}}]}, 400, "tools.0"),
    ({"messages": ASK, "tool_choice": "auto"}, 400, "tool_choice"),
    ({"messages": ASK, "chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs"),
    ({"messages": [{"role": "developer", "content": "hi"}, *ASK]}, 400, "messages"),  # a role it does not know
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     400, "messages.0.content.0"),  # (a text-only folder: no vision tower; the part is named)
    ({"messages": ASK, "max_tokens": "many"}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x " * 1200}]}, 400, None),  # past the context
    pytest.param({"messages": ASK, "structured_outputs": {"regex": "("}, "max_tokens": 4}, 400,
                 "structured_outputs.regex", marks=needs_xgrammar),
])
def test_bad_requests_leave_the_engine_serving(qwen35_server, body, status, param):
    before, _ = _chat(qwen35_server, ASK, **OFF)
    err = check_error(httpx.post(qwen35_server.url + "/v1/chat/completions", json=body, timeout=60), status, param)
    if param is None:
        assert err["code"] == "context_length_exceeded", err
    assert httpx.get(qwen35_server.url + "/health", timeout=10).status_code == 200
    assert _chat(qwen35_server, ASK, **OFF)[0] == before


def test_dropped_stream_leaves_the_engine_serving(qwen35_server):
    """A client gone mid-stream: its request is aborted (its KV blocks and state slot given
    back) and the next answers are unchanged."""
    before, _ = _chat(qwen35_server, ASK)
    body = {"messages": ASK, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", qwen35_server.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            it, lines = r.iter_lines(), []
            while len(lines) < 4:
                line = next(it)
                if line.startswith("data:"):
                    lines.append(line)
            assert qwen35_server.metrics()["blitz_num_requests_running"] == 1
            del it
    deadline = time.monotonic() + 5
    while (m := qwen35_server.metrics())["blitz_num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert m["blitz_num_requests_running"] == 0 and m["blitz_kv_cache_usage_perc"] == 0, m
    assert _chat(qwen35_server, ASK)[0] == before
