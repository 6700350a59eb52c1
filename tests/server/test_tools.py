"""Tool calls (``--enable-auto-tool-choice --tool-call-parser hermes``): the hermes splitter on
hand-derived outputs, streamed in every chunking equal to the whole; request validation. (The
server's side runs in tests/server/test_reasoning.py's tiny thinking-and-tools server.)"""
from __future__ import annotations

import json
import random

import pytest

from blitzllm.server.errors import APIError
from blitzllm.server.tools import Forced, ToolCallSplitter, check_tools, split_tool_calls, template_messages

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
TIME = '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'

CASES = [
    # (content from the model, expected content, expected [(name, arguments)])
    (WEATHER, None, [("get_weather", '{"city": "Paris", "unit": "C"}')]),
    ("Let me check.\n" + WEATHER, "Let me check.\n", [("get_weather", '{"city": "Paris", "unit": "C"}')]),
    (WEATHER + "\n" + TIME + "\n", None, [("get_weather", '{"city": "Paris", "unit": "C"}'),
                                         ("get_time", '{"tz": "UTC"}')]),
    ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', None, [("f", '{"x": 1}')]),
    ('<tool_call>{"name": "ping"}</tool_call>', None, [("ping", "{}")]),
    ("plain answer", "plain answer", []),
    ("<tool_call>not json</tool_call> tail", "<tool_call>not json</tool_call> tail", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('unclosed <tool_call>{"name": "f"', 'unclosed <tool_call>{"name": "f"', []),
    ("a <tool_ca", "a <tool_ca", []),
    ("", "", []),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_split_whole(text, content, calls):
    got_content, got = split_tool_calls(text)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got)
    assert len({c["id"] for c in got}) == len(got)


def _streamed(sp, text: str, cut: list) -> tuple:
    """(content, calls) of ``text`` fed to splitter ``sp`` in the pieces ``cut`` makes."""
    texts, calls = [], []
    for piece in [text[a:b] for a, b in zip([0] + cut, cut + [len(text)])]:
        t, c = sp.feed(piece)
        texts.append(t)
        calls.extend(c)
    texts.append(sp.finish()[0])
    return "".join(texts), calls


@pytest.mark.parametrize("text,content,calls", CASES)
def test_split_streamed_in_every_chunking(text, content, calls):
    rng = random.Random(len(text))
    cuts = [[i] for i in range(len(text) + 1)] + [sorted(rng.sample(range(len(text) + 1), min(len(text), 6)))
                                                   for _ in range(20)]
    for cut in cuts:
        joined, got = _streamed(ToolCallSplitter(), text, cut)
        if content is None:  # (only whitespace beside the calls: the whole answer says None)
            assert not joined.strip()
        else:
            assert joined == content
        assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in got] == \
            [(i, n, a) for i, (n, a) in enumerate(calls)], cut


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("tools,choice,parser,match", [
    ([{"type": "function"}], "auto", "hermes", "tools.0"),
    ([{"type": "function", "function": {"name": ""}}], None, "hermes", "tools.0"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "hermes", "tool_choice must be"),
    (TOOLS, "sometimes", "hermes", "tool_choice must be"),
    (TOOLS, "auto", None, "--enable-auto-tool-choice"),
    (None, "auto", "hermes", "tool_choice needs tools"),
])
def test_check_tools_errors(tools, choice, parser, match):
    with pytest.raises(APIError, match=match):
        check_tools(tools, choice, parser)


def test_check_tools_and_template_messages():
    assert check_tools(TOOLS, None, "hermes") == "auto" == check_tools(TOOLS, "auto", "hermes")
    assert check_tools(TOOLS, "none", None) is None and check_tools(None, None, None) is None
    assert isinstance(check_tools(TOOLS, "required", None), Forced)  # (forced choices need no parser)
    conv = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]
    out = template_messages(json.loads(json.dumps(conv)))
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert out[0]["tool_calls"][1]["function"]["arguments"] == "not json"


@pytest.mark.parametrize("flags", [["--enable-auto-tool-choice"], ["--tool-call-parser", "hermes"]])
def test_tool_flags_go_together(flags):
    from blitzllm.cli import build_parser
    from blitzllm.server.app import config_from_args
    with pytest.raises(ValueError, match="go together"):
        config_from_args(build_parser().parse_args(["serve", *flags]))
    cfg = config_from_args(build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser",
                                                      "hermes"]))
    assert cfg.tool_call_parser == "hermes"


TWO = TOOLS + [{"type": "function", "function": {"name": "get_time"}}]


def test_forced_choices():
    named = check_tools(TWO, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.structured_output() == {"type": "json_schema", "schema": {"type": "object"}}
    calls = named.calls('{"city": "Paris"}')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"})]
    assert named.calls('{"city": "Par') == []  # cut short: no calls
    req = check_tools(TWO, "required", None)
    schema = req.structured_output()["schema"]
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in req.calls(text)] == \
        [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]
    sp = req.splitter()
    assert sp.feed(text[:10]) == ("", []) and sp.feed(text[10:]) == ("", [])
    content, calls = sp.finish()
    assert content == "" and [c["index"] for c in calls] == [0, 1]
    sp = req.splitter()
    sp.feed("[{")
    assert sp.finish() == ("[{", [])


# DeepSeek's markers: fullwidth vertical line U+FF5C and lower one-eighth block U+2581
B, E = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
CB, CE, SEP = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>", "<\uff5ctool\u2581sep\uff5c>"
DS_CASES = [
    ("deepseek_v3", "Let me check." + B + CB + "function" + SEP + 'get_weather\n```json\n{"city": "Paris"}\n```' + CE
     + CB + "function" + SEP + "get_time\n```json\n{}\n```" + CE + E,
     "Let me check.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ("deepseek_v31", B + CB + "get_weather" + SEP + '{"city": "Paris"}' + CE + E, None,
     [("get_weather", '{"city": "Paris"}')]),
    ("deepseek_v31", "plain", "plain", []),
    ("deepseek_v31", B + CB + "f" + SEP + "{broken" + CE + E, CB + "f" + SEP + "{broken" + CE, []),
    # DeepSeek-V3.2's DSML: string="true" values as they are, string="false" ones JSON
    ("deepseek_v32", "Sure.\n<\uff5cDSML\uff5cfunction_calls>\n<\uff5cDSML\uff5cinvoke name=\"get_weather\">\n"
     '<\uff5cDSML\uff5cparameter name="city" string="true">New York</\uff5cDSML\uff5cparameter>\n'
     '<\uff5cDSML\uff5cparameter name="days" string="false">[1, 2]</\uff5cDSML\uff5cparameter>\n'
     "</\uff5cDSML\uff5cinvoke>\n<\uff5cDSML\uff5cinvoke name=\"get_time\">\n</\uff5cDSML\uff5cinvoke>\n"
     "</\uff5cDSML\uff5cfunction_calls>",
     "Sure.\n", [("get_weather", '{"city": "New York", "days": [1, 2]}'), ("get_time", "{}")]),
    ("deepseek_v32", '<\uff5cDSML\uff5cfunction_calls><\uff5cDSML\uff5cinvoke name="f"><\uff5cDSML\uff5cparameter '
     'name="n" string="false">{oops</\uff5cDSML\uff5cparameter></\uff5cDSML\uff5cinvoke></\uff5cDSML\uff5cfunction_calls>',
     '<\uff5cDSML\uff5cfunction_calls><\uff5cDSML\uff5cinvoke name="f"><\uff5cDSML\uff5cparameter '
     'name="n" string="false">{oops</\uff5cDSML\uff5cparameter></\uff5cDSML\uff5cinvoke></\uff5cDSML\uff5cfunction_calls>', []),
    # Kimi-K2 (its markers written out: they are special tokens, decoded for these requests)
    ("kimi_k2", "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
     "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
     "Checking.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ("kimi_k2", "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{bad<|tool_call_end|>",
     "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{bad<|tool_call_end|>", []),
]


@pytest.mark.parametrize("parser,text,content,calls", DS_CASES)
def test_deepseek_formats(parser, text, content, calls):
    from blitzllm.server.tools import FORMATS
    got_content, got = split_tool_calls(text, parser)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls
    if parser == "kimi_k2":   # (Kimi's ids, which its template writes back in later turns)
        assert [c["id"] for c in got] == [f"functions.{n}:{i}" for i, (n, _) in enumerate(calls)]
        assert FORMATS[parser].special_tokens
    rng = random.Random(len(text))
    for _ in range(30):  # streamed in random pieces (the markers split anywhere)
        cut = sorted(rng.sample(range(len(text) + 1), min(len(text), 8)))
        joined, streamed = _streamed(ToolCallSplitter(FORMATS[parser]), text, cut)
        assert joined == (content or "")
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == calls


MM_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "detailed": {"type": "boolean"},
    "hours": {"type": "array", "items": {"type": "integer"}}}}}},
            {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
                "tz": {"type": "string"}}}}}]
MM = ('Let me search for that.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
      '<parameter name="city">New York</parameter>\n<parameter name="days">3</parameter>\n'
      '<parameter name="detailed">true</parameter>\n<parameter name="hours">[9, 12]</parameter>\n</invoke>\n'
      '<invoke name="get_time">\n<parameter name="tz">42</parameter>\n</invoke>\n</minimax:tool_call>')


def test_minimax_m2_format():
    """Several invokes in one block, each parameter typed by the tool's schema (a string-typed
    "42" stays a string); the text before stays content; streamed in random pieces alike."""
    from blitzllm.server.tools import FORMATS
    content, calls = split_tool_calls(MM, "minimax_m2", MM_TOOLS)
    assert content == "Let me search for that.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "New York", "days": 3, "detailed": True, "hours": [9, 12]}),
        ("get_time", {"tz": "42"})]
    rng = random.Random(1)
    for _ in range(30):
        cut = sorted(rng.sample(range(len(MM) + 1), 8))
        joined, streamed = _streamed(ToolCallSplitter(FORMATS["minimax_m2"], MM_TOOLS), MM, cut)
        assert joined == content and [c["function"]["arguments"] for c in streamed] == \
            [c["function"]["arguments"] for c in calls]
    # no invoke inside: the block stays text
    bad = "<minimax:tool_call>nothing</minimax:tool_call>"
    assert split_tool_calls(bad, "minimax_m2", MM_TOOLS) == (bad, [])
