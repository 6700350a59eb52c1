"""Tool calls in chat completions (``--enable-auto-tool-choice --tool-call-parser NAME``): each
parser's block format, the model's blocks as OpenAI ``tool_calls`` (whole or streamed), and the
structured outputs that force "required" or a named function. Knows nothing about the engine
or HTTP (docs/serving.md#tool-calls).
"""
from __future__ import annotations

import json
import re
from functools import partial
from typing import Optional

from .errors import bad_request
from .reasoning import _held_tail, fed
from .tool_formats import LLAMA3_JSON, MISTRAL, PYTHONIC, tool_call

TOOL_PARSERS = ("hermes", "deepseek_v3", "deepseek_v31", "deepseek_v32", "kimi_k2", "minimax_m2", "qwen3_coder", "glm45", "glm47",
                "llama3_json", "pythonic", "mistral")
START, END = "<tool_call>", "</tool_call>"


def check_tools(tools, tool_choice, parser: Optional[str]):
    """Validates a request's ``tools`` / ``tool_choice``. Returns None (no tools: nothing parsed,
    none in the prompt), "auto" (parse the output's blocks) or a ``Forced`` choice."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools.{i} must be {{'type': 'function', 'function': {{'name': ..., "
                              f"'parameters': ...}}}}", param=f"tools.{i}")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if choice == "required":
        if not tools:
            raise bad_request("tool_choice 'required' needs at least one tool", param="tools")
        return Forced(None, tools)
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        match = [t for t in tools if t["function"]["name"] == name]
        if not match:
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                              "{'name': <one of the tools>}}", param="tool_choice")
        return Forced(name, match)
    if choice != "auto":
        raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                          param="tool_choice")
    if parser is None:
        raise bad_request("tools with tool_choice 'auto' need the server started with --enable-auto-tool-choice "
                          f"--tool-call-parser ({', '.join(TOOL_PARSERS)})", param="tools")
    return "auto"


def _parameters(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


class Forced:
    """A forced tool choice: ``name`` (one named function) or None ("required": any of ``tools``)."""

    def __init__(self, name: Optional[str], tools: list):
        self.name, self.tools = name, tools

    def structured_output(self) -> dict:
        if self.name is not None:
            return {"type": "json_schema", "schema": _parameters(self.tools[0])}
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                   "parameters": _parameters(t)},
                  "required": ["name", "parameters"]} for t in self.tools]
        return {"type": "json_schema", "schema": {"type": "array", "minItems": 1, "items": {"anyOf": items}}}

    def calls(self, text: str) -> list:
        """The tool calls of a whole answer (empty when it is not complete JSON)."""
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):  # (not JSON, a number past int's digit limit, too deep)
            return []
        if self.name is not None:
            pairs = [(self.name, obj)]
        elif isinstance(obj, list):
            pairs = [(o.get("name"), o.get("parameters", {})) for o in obj if isinstance(o, dict)]
        else:
            return []
        calls = [tool_call(n, a if isinstance(a, dict) else {}) for n, a in pairs]
        return [c for c in calls if c is not None]

    def splitter(self) -> "ForcedSplitter":
        return ForcedSplitter(self)


class ForcedSplitter:
    """A forced choice's stream: the answer held until it ends, then its calls (or, cut short,
    its text as content)."""

    def __init__(self, forced: Forced):
        self.forced, self.buf = forced, ""

    def feed(self, text: str) -> tuple[str, list]:
        self.buf += text
        return "", []

    def finish(self) -> tuple[str, list]:
        calls = self.forced.calls(self.buf)
        rest, self.buf = self.buf, ""
        return ("", [{"index": i, **c} for i, c in enumerate(calls)]) if calls else (rest, [])


def template_messages(conv: list) -> list:
    """Chat messages for the template: an assistant's tool-call ``arguments`` JSON string as a
    mapping (templates write it with ``tojson``, as vLLM hands it to them)."""
    for m in conv:
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    args = json.loads(fn["arguments"])
                except (ValueError, RecursionError):
                    continue
                if isinstance(args, dict):
                    fn["arguments"] = args
    return conv


def _hermes_call(inner: str, tools=None) -> Optional[dict]:
    """``{"name": ..., "arguments": {...}}`` (or "parameters")."""
    try:
        obj = json.loads(inner.strip())
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    return tool_call(obj.get("name"), obj.get("arguments", obj.get("parameters", {})))


_SEP = "<\uff5ctool\u2581sep\uff5c>"  # DeepSeek's <｜tool▁sep｜> (fullwidth bar, lower one-eighth block)


def _deepseek_v3_call(inner: str, tools=None) -> Optional[dict]:
    """DeepSeek-V3: ``function<｜tool▁sep｜>NAME`` newline, then the arguments in a ```json fence."""
    kind, sep, rest = inner.partition(_SEP)
    if not sep or kind.strip() != "function":
        return None
    name, _, body = rest.partition("\n")
    body = body.strip()
    if body.startswith("```json") and body.endswith("```"):
        body = body[len("```json"):-3]
    return tool_call(name.strip(), body.strip())


def _deepseek_v31_call(inner: str, tools=None) -> Optional[dict]:
    """DeepSeek-V3.1 and V3.2-Exp: ``NAME<｜tool▁sep｜>ARGUMENTS``."""
    name, sep, args = inner.partition(_SEP)
    return tool_call(name.strip(), args.strip()) if sep else None


# DeepSeek-V3.2's DSML (fullwidth bars as DeepSeek's other markers): <｜DSML｜function_calls>, per call
# <｜DSML｜invoke name="NAME"> with <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>
# elements (string="false": the value is JSON), </｜DSML｜invoke>, then </｜DSML｜function_calls>
_DSML = "\uff5cDSML\uff5c"
_DSML_INVOKE = re.compile(rf'<{_DSML}invoke name="([^"]+)">(.*?)</{_DSML}invoke>', re.S)
_DSML_PARAM = re.compile(rf'<{_DSML}parameter name="([^"]+)"(?: string="(true|false)")?>(.*?)</{_DSML}parameter>', re.S)


def _dsml_calls(inner: str, tools=None) -> Optional[list]:
    """A DSML block's invokes; a ``string="false"`` value must be JSON (else the block stays text)."""
    calls = []
    for name, body in _DSML_INVOKE.findall(inner):
        args = {}
        for key, is_string, value in _DSML_PARAM.findall(body):
            try:
                args[key] = value if is_string != "false" else json.loads(value)
            except (ValueError, RecursionError):
                return None
        calls.append(tool_call(name.strip(), args))
    return calls if calls and all(calls) else None


# Kimi-K2 (DeepSeek-V3's architecture): <|tool_call_begin|>functions.NAME:INDEX
# <|tool_call_argument_begin|>ARGUMENTS<|tool_call_end|>, in a calls section; the markers are special tokens
_KIMI = ("<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>")
_KIMI_DROP = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")


def _kimi_k2_call(inner: str, tools=None) -> Optional[dict]:
    """``functions.NAME:INDEX`` (kept as the call's id: Kimi's template writes it back so in
    later turns), the argument marker, then the arguments' JSON."""
    ident, sep, args = inner.partition(_KIMI[2])
    ident = ident.strip()
    m = re.fullmatch(r"(?:functions\.)?([\w.\-]+?)(?::\d+)?", ident)
    return tool_call(m.group(1), args.strip(), call_id=ident) if sep and m else None


# MiniMax-M2: one or more <invoke name="NAME"><parameter name="KEY">VALUE</parameter>...</invoke>
_INVOKE = re.compile(r'<invoke name="([^"]+)">(.*?)</invoke>', re.S)
_PARAM = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.S)
# Qwen3.5 / Qwen3-Coder: <function=NAME> with <parameter=KEY> newline VALUE newline </parameter>
# elements (a value may span lines)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_QPARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


# GLM-4.5 / 4.6 (newlines between the parts) and GLM-4.7 / 5 (none): <tool_call>NAME, then
# <arg_key>KEY</arg_key><arg_value>VALUE</arg_value> pairs, </tool_call>
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _glm_call(inner: str, tools=None) -> Optional[dict]:
    """A GLM call: the name up to the first ``<arg_key>``, the values typed by the request's
    schemas (the templates write a non-string value as JSON)."""
    name, _, rest = inner.partition("<arg_key>")
    name = name.strip()
    if not re.fullmatch(r"[\w.\-]+", name) or (rest and not _GLM_ARG.search("<arg_key>" + rest)):
        return None   # (a function name, OpenAI's characters and dots; pairs where keys begin)
    props = next((((t["function"].get("parameters") or {}).get("properties") or {}) for t in tools or ()
                  if isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name") == name),
                 {})
    return tool_call(name, {k.strip(): _typed(v, props.get(k.strip())) for k, v in _GLM_ARG.findall(inner)})


def _typed(value: str, schema) -> object:
    """An XML-style parameter's text as its schema's type: JSON for non-string types where it parses,
    else the text."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    text = value.strip()
    if kind in (None, "string") or isinstance(kind, list) and "string" in kind:
        return text
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _xml_calls(inner: str, tools, invoke: re.Pattern, param: re.Pattern) -> Optional[list]:
    """Calls written as XML-like elements: ``invoke`` finds (name, body) pairs, ``param`` the
    (key, value) pairs of a body; values typed by the request's tool schemas."""
    props = {t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties") or {}
             for t in tools or () if isinstance(t, dict) and isinstance(t.get("function"), dict)}
    calls = []
    for name, body in invoke.findall(inner):
        p = props.get(name.strip(), {})
        args = {k.strip(): _typed(v, p.get(k.strip())) for k, v in param.findall(body)}
        calls.append(tool_call(name.strip(), args))
    return calls if calls and all(calls) else None


class ToolFormat:
    """A model's tool-call blocks: ``start`` ... ``end`` around each call (or several: ``parse``
    returns a list then), whose inner text ``parse`` reads with the request's tools; ``drop``:
    markers around a run of calls, removed from the content. (``tool_formats.BracketFormat``
    has the same ``scan`` / ``calls`` for formats without an end marker.)"""

    def __init__(self, start: str, end: str, parse, drop: tuple = (), special_tokens: bool = False):
        self.start, self.end, self.parse, self.drop = start, end, parse, drop
        self.special_tokens = special_tokens   # (its markers are special tokens: its requests decode them)

    def scan(self, buf: str, final: bool, memo=None) -> tuple[int, Optional[int]]:
        """(i, j): ``buf[:i]`` is content; ``buf[i:j]`` a block, or with j None, ``buf[i:]`` held
        (a block's start, or an open block: content if the text ends so)."""
        i = buf.find(self.start)
        if i < 0:
            return len(buf) - (0 if final else _held_tail(buf, self.start)), None
        j = buf.find(self.end, i + len(self.start))
        return i, None if j < 0 else j + len(self.end)

    def calls(self, block: str, tools):
        return self.parse(block[len(self.start):-len(self.end)], tools)


_DS_BEGIN, _DS_END = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>"
_DS_DROP = ("<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>")
FORMATS = {
    "hermes": ToolFormat(START, END, _hermes_call),
    "deepseek_v3": ToolFormat(_DS_BEGIN, _DS_END, _deepseek_v3_call, _DS_DROP),
    "deepseek_v31": ToolFormat(_DS_BEGIN, _DS_END, _deepseek_v31_call, _DS_DROP),
    "deepseek_v32": ToolFormat(f"<{_DSML}function_calls>", f"</{_DSML}function_calls>", _dsml_calls),
    "kimi_k2": ToolFormat(_KIMI[0], _KIMI[1], _kimi_k2_call, _KIMI_DROP, special_tokens=True),
    "minimax_m2": ToolFormat("<minimax:tool_call>", "</minimax:tool_call>",
                             partial(_xml_calls, invoke=_INVOKE, param=_PARAM)),
    "qwen3_coder": ToolFormat(START, END, partial(_xml_calls, invoke=_FUNCTION, param=_QPARAM)),
    "glm45": ToolFormat(START, END, _glm_call),
    "glm47": ToolFormat(START, END, _glm_call),
    "llama3_json": LLAMA3_JSON,
    "pythonic": PYTHONIC,
    "mistral": MISTRAL,
}


class ToolCallSplitter:
    """One sequence's content, fed as it streams, split into text and tool calls (``fmt``:
    the model's blocks, hermes by default; its ``scan`` says where they are, its ``calls``
    what they hold)."""

    def __init__(self, fmt=None, tools=None):
        self.fmt, self.tools = fmt or FORMATS["hermes"], tools
        self.buf = ""
        self.calls = 0
        self.memo: dict = {}  # (the format's notes on the text it holds, read once)

    def feed(self, text: str, final: bool = False) -> tuple[str, list]:
        """(content text, [tool call dicts with their index]) that ``text`` completes."""
        f = self.fmt
        self.buf += text
        for marker in f.drop:
            if marker in self.buf:  # (the held text changed: read it again)
                self.buf, self.memo = self.buf.replace(marker, ""), {}
        out, calls = [], []
        while self.buf:
            i, j = f.scan(self.buf, final, self.memo)
            if j is None:
                if not final:  # (a marker to drop may be arriving)
                    i = min(i, len(self.buf) - max((_held_tail(self.buf, m) for m in f.drop), default=0))
                out.append(self.buf[:i])
                self.buf = self.buf[i:]
                break
            out.append(self.buf[:i])
            block, self.buf, self.memo = self.buf[i:j], self.buf[j:], {}
            parsed = f.calls(block, self.tools)
            if parsed is None:
                out.append(block)
                continue
            for call in parsed if isinstance(parsed, list) else [parsed]:
                calls.append({"index": self.calls, **call})
                self.calls += 1
        return "".join(out), calls

    def finish(self) -> tuple[str, list]:
        """What was held back, once the sequence has ended: a complete call, else text (an
        unclosed block)."""
        content, calls = self.feed("", final=True)
        rest, self.buf = self.buf, ""
        return content + rest, calls


def split_tool_calls(text: Optional[str], parser: str = "hermes", tools=None) -> tuple[Optional[str], list]:
    """(content, tool_calls) of a whole output's content: content None when only whitespace
    is left beside calls."""
    if text is None:
        return None, []
    content, calls = fed(ToolCallSplitter(FORMATS[parser], tools), text)
    if calls and not content.strip():
        content = None
    return content, [{k: v for k, v in c.items() if k != "index"} for c in calls]
