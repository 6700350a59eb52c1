"""The formats without an end marker (``llama3_json``, ``pythonic``, ``mistral``; vLLM's names):
outputs written the way each model's format has them, split whole and streamed in every
chunking (char by char, random pieces) into the same content and calls; several calls, text
before and after them, malformed calls left as content. The server's side (stream and not,
finish_reason tool_calls) runs in tests/server/test_tool_formats_serve.py."""
from __future__ import annotations

import json
import random

import pytest

from blitzllm.server.tools import FORMATS, TOOL_PARSERS, ToolCallSplitter, split_tool_calls

W = {"city": "Paris", "days": 3}
CASES = [
    # (parser, the model's text, content, [(name, arguments)])
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None, [("get_weather", W)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}; '
     '{"name": "get_time", "parameters": {"tz": "UTC; {x}"}}', None, [("get_weather", W), ("get_time", {"tz": "UTC; {x}"})]),
    ("llama3_json", 'Let me look.\n{"name": "get_time", "parameters": {}} Done.', "Let me look.\n Done.",
     [("get_time", {})]),
    ("llama3_json", 'A set {1, 2}, a dict {"a": 1} and {"name": "x"}; end', 'A set {1, 2}, a dict {"a": 1} and {"name": "x"}; end', []),
    ("llama3_json", '{"name": "f", "parameters": {"a": [1}}', '{"name": "f", "parameters": {"a": [1}}', []),  # mismatched
    ("llama3_json", '{"name": "f", "parameters": {"a": 1', '{"name": "f", "parameters": {"a": 1', []),       # cut short
    ("llama3_json", "plain text", "plain text", []),
    ("llama3_json", '{"name": "f", "parameters": {"s": "a\\"}]\\\\"}}', None, [("f", {"s": 'a"}]\\'})]),  # escapes
    ("pythonic", '[get_weather(city="Paris", days=3), get_time(tz=\'UTC\')]', None,
     [("get_weather", W), ("get_time", {"tz": "UTC"})]),
    ("pythonic", 'Sure! [get_weather(city="Pa]ris", days=-3, hours=[9, 12], extra={"k": None, "b": True}), ping()]\nok',
     "Sure! \nok", [("get_weather", {"city": "Pa]ris", "days": -3, "hours": [9, 12], "extra": {"k": None, "b": True}}),
                    ("ping", {})]),
    ("pythonic", "[1, 2] [see](url) [f(x)] [g(a=b)] [h(a=1)", "[1, 2] [see](url) [f(x)] [g(a=b)] [h(a=1)", []),
    ("pythonic", "[f(a=float('nan'))] [f(a={1, 2})]", "[f(a=float('nan'))] [f(a={1, 2})]", []),
    ("pythonic", "[f(s='it\\'s ]', t=\"(\")]", None, [("f", {"s": "it's ]", "t": "("})]),
    ("mistral", 'Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
     '{"name": "get_time", "arguments": {"tz": "UTC"}}]', "Checking.", [("get_weather", W), ("get_time", {"tz": "UTC"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e'
     '[ARGS] {"tz": "UTC"}', None, [("get_weather", W), ("get_time", {"tz": "UTC"})]),
    ("mistral", 'Hm [TOOL_CALLS]get_weather{"city": "Paris", "days": 3}', "Hm ", [("get_weather", W)]),
    ("mistral", '[TOOL_CALLS] no call [TOOL_CALLS]f[ARGS]{"a": 1 [TOOL_CALLS][{"arguments": {}}]',
     '[TOOL_CALLS] no call [TOOL_CALLS]f[ARGS]{"a": 1 [TOOL_CALLS][{"arguments": {}}]', []),
]


def _streamed(sp, text: str, cut: list) -> tuple:
    """(content, calls) of ``text`` fed to splitter ``sp`` in the pieces ``cut`` makes, with
    what its finish gives (a call may end with the text)."""
    texts, calls = [], []
    for piece in [text[a:b] for a, b in zip([0] + cut, cut + [len(text)])] + [None]:
        t, c = sp.feed(piece) if piece is not None else sp.finish()
        texts.append(t)
        calls.extend(c)
    return "".join(texts), calls


def _pairs(calls) -> list:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_whole_and_streamed(parser, text, content, calls):
    assert parser in TOOL_PARSERS
    got_content, got = split_tool_calls(text, parser)
    assert (got_content, _pairs(got)) == (content, calls)
    assert len({c["id"] for c in got}) == len(got) and all(c["type"] == "function" for c in got)
    if parser == "mistral":  # (Mistral's templates want ids of 9 letters or digits)
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got)
    rng = random.Random(len(text))
    cuts = [list(range(1, len(text)))] + [sorted(rng.sample(range(len(text) + 1), min(len(text), k)))
                                          for k in (2, 5, 9) for _ in range(10)]
    for cut in cuts:
        joined, streamed = _streamed(ToolCallSplitter(FORMATS[parser]), text, cut)
        assert joined == (content or "") if content is not None else not joined.strip(), cut
        assert [c["index"] for c in streamed] == list(range(len(calls)))
        assert _pairs(streamed) == calls, cut


def test_a_stream_holds_back_only_what_may_become_a_call():
    """Content flows until a call may start: ordinary text is not held, a possible start is."""
    for parser, text, held in [("llama3_json", 'See {x} and { ', "{ "), ("pythonic", "A [b] c [get_we", "[get_we"),
                               ("mistral", "Ok [TOOL_CA", "[TOOL_CA"), ("mistral", "Ok [TOOL_CALLS]get_weather", None)]:
        sp = ToolCallSplitter(FORMATS[parser])
        content, calls = sp.feed(text)
        want = text[:len(text) - len(held)] if held else "Ok "
        assert (content, calls) == (want, []), parser
        assert sp.finish() == (text[len(want):], [])


def test_llama3_waits_for_a_separator_after_a_call():
    """A call's closing brace may be followed by ``;``: the call comes out once the next
    non-space text (or the end) says."""
    sp = ToolCallSplitter(FORMATS["llama3_json"])
    assert sp.feed('{"name": "f", "parameters": {}}  ') == ("", [])
    content, calls = sp.feed(";")
    assert content == "" and _pairs(calls) == [("f", {})]
    sp = ToolCallSplitter(FORMATS["llama3_json"])
    sp.feed('{"name": "f", "parameters": {}}')
    content, calls = sp.finish()
    assert content == "" and _pairs(calls) == [("f", {})]


def test_a_long_call_is_read_once():
    """A call streamed in small pieces: the bracket matching goes on where it stopped (its state
    kept for the held text), not from the call's start on every piece; the same call comes out."""
    args = {"items": [f"item {i}" for i in range(3000)]}
    text = "Here.\n" + json.dumps({"name": "save", "parameters": args})
    sp = ToolCallSplitter(FORMATS["llama3_json"])
    content = sp.feed(text[:len(text) // 2])[0]
    (stack, quote, at), = sp.memo.values()
    assert content == "Here.\n" and at == len(sp.buf) and stack == ["}", "}", "]"]
    joined, calls = _streamed(sp, text[len(text) // 2:], list(range(3, len(text) // 2, 3)))
    assert content + joined == "Here.\n" and _pairs(calls) == [("save", args)]
