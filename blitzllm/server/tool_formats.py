"""Tool-call formats that have no closing marker of their own (``llama3_json``, ``pythonic``,
``mistral``): where each of their calls starts and ends in a model's text, found by matching
brackets, and what the call says. ``tools.py``'s splitter drives them, streamed or whole, through
the same ``scan`` / ``calls`` pair its marker-delimited formats have (docs/serving.md#tool-calls).
"""
from __future__ import annotations

import ast
import json
import random
import re
import string
import uuid
from typing import Optional

from .reasoning import _held_tail


def tool_call(name, args, call_id: Optional[str] = None) -> Optional[dict]:
    """An OpenAI tool call (a fresh id unless given), or None without a name; ``args`` a mapping
    or a JSON string."""
    if not isinstance(name, str) or not name:
        return None
    if isinstance(args, str):
        try:
            json.loads(args)
        except (ValueError, RecursionError):
            return None
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


_CLOSE = {"[": "]", "{": "}", "(": ")"}


_STRUCT = re.compile(r"[\[\]{}()\"'\\]")  # (the characters bracket matching looks at)


def _balanced_end(text: str, i: int, quotes: str, memo: Optional[dict] = None) -> Optional[int]:
    """The index just past the bracket that closes ``text[i]``, skipping brackets inside strings
    (delimited by any of ``quotes``, backslash escapes); None while the text may still close it,
    -1 when a bracket of the wrong kind closes first (it never will). ``memo`` keeps where an
    unclosed one got to, so that a stream's growing text is read once, not on every token."""
    stack, quote, skip = memo.pop(i, ([], None, i)) if memo is not None else ([], None, i)
    for m in _STRUCT.finditer(text, skip):
        k, c = m.start(), m.group()
        if k < skip:  # (the character after a backslash in a string)
            continue
        if quote:
            if c == "\\":
                skip = k + 2
            elif c == quote:
                quote = None
        elif c in quotes:
            quote = c
        elif c in _CLOSE:
            stack.append(_CLOSE[c])
        elif c in "]})":
            if not stack or stack.pop() != c:
                return -1
            if not stack:
                return k + 1
    if memo is not None:
        memo[i] = (stack, quote, max(skip, len(text)))
    return None


class BracketFormat:
    """A format whose calls are found by bracket matching: ``start`` matches where a call begins,
    up to its opening bracket (the call runs to the bracket that closes it); ``maybe(tail)`` says
    whether a tail of the text (beginning with ``opener``) could still become a start; ``read``
    turns a call's text into calls (None: not a call, it stays content); ``sep``: a separator
    that goes with the call before it; ``drop``: markers removed from the content;
    ``special_tokens``: the markers are special tokens, so its requests decode them (as vLLM's
    Mistral parser asks)."""

    WINDOW = 256  # (the longest tail held while it may still become a start)

    def __init__(self, start: re.Pattern, opener: str, maybe, read, quotes: str, sep: Optional[re.Pattern] = None,
                 drop: tuple = (), special_tokens: bool = False):
        self.start, self.opener, self.maybe, self.read, self.quotes = start, opener, maybe, read, quotes
        self.sep, self.drop, self.special_tokens = sep, drop, special_tokens

    def scan(self, buf: str, final: bool, memo: Optional[dict] = None) -> tuple[int, Optional[int]]:
        """(i, j): ``buf[:i]`` is content; ``buf[i:j]`` a call's text, or with j None, ``buf[i:]``
        held (it may become one; at ``final`` it is content). Decided from the text after i only,
        so every chunking of a stream decides alike. ``memo``: the splitter's, kept while it
        holds ``buf[i:]`` and only appends to it."""
        pos = 0
        while True:
            m = self.start.search(buf, pos)
            if m is None:
                if not final:
                    for k in range(max(pos, len(buf) - self.WINDOW), len(buf)):
                        if buf[k] == self.opener and self.maybe(buf[k:]):
                            return k, None
                return len(buf), None
            i, opener = m.start(), m.end() - 1
            end = _balanced_end(buf, opener, self.quotes, memo)
            if end is None:  # the call may still close: held (its state where buf[i:] will start)
                if memo is not None:
                    stack, quote, skip = memo.pop(opener)
                    memo[opener - i] = stack, quote, skip - i
                return i, None
            if end < 0:
                pos = i + 1
                continue
            if self.sep is not None:  # (a separator may follow: wait for it)
                s = self.sep.match(buf, end)
                if s is not None:
                    return i, s.end()
                if not final and not buf[end:].strip():
                    return i, None
            return i, end

    def calls(self, block: str, tools) -> Optional[list]:
        return self.read(block, tools)


def _named_call(obj) -> Optional[dict]:
    """``{"name": ..., "parameters"|"arguments": {...}}`` as a call; None for other JSON."""
    if not isinstance(obj, dict):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    return tool_call(obj.get("name"), args) if isinstance(args, dict) else None


def _llama3_calls(block: str, tools=None) -> Optional[list]:
    """One JSON object (with its trailing ``;``) of Llama 3.x's JSON tool calling."""
    try:
        obj = json.loads(block.strip().removesuffix(";"))
    except (ValueError, RecursionError):
        return None
    call = _named_call(obj)
    return [call] if call else None


# Llama 3.1 / 3.2 / 3.3: {"name": ..., "parameters": {...}} objects, ";" between them, after an
# optional <|python_tag|> (a special token: there only when special tokens are decoded)
LLAMA3_JSON = BracketFormat(re.compile(r'\{(?=\s*")'), "{", re.compile(r"\{\s*").fullmatch, _llama3_calls, '"',
                            sep=re.compile(r"\s*;"), drop=("<|python_tag|>",))


def _pythonic_calls(block: str, tools=None) -> Optional[list]:
    """``[f(a=1, b="x"), g()]``: a list of calls by name with literal keyword arguments."""
    try:
        tree = ast.parse(block.strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for c in tree.elts:
            if not isinstance(c, ast.Call) or not isinstance(c.func, ast.Name) or c.args \
                    or any(k.arg is None for k in c.keywords):
                return None  # (positional or ** arguments have no names to give)
            args = {k.arg: ast.literal_eval(k.value) for k in c.keywords}  # (literals only, never run)
            calls.append(tool_call(c.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False)))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


# Llama 3.2 / 4 and others: a Python list of calls, text around it stays content
PYTHONIC = BracketFormat(re.compile(r"\[(?=\s*[A-Za-z_]\w*\s*\()"), "[",
                         re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?").fullmatch, _pythonic_calls, "'\"")


_MARK = "[TOOL_CALLS]"
_ALNUM = string.ascii_letters + string.digits
# v11+: [TOOL_CALLS]NAME[ARGS]{...}, [CALL_ID]ID before [ARGS] in some, [ARGS] absent where the
# special tokens were skipped; before v11: [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
_MS_NAME, _MS_TAGS = r"[A-Za-z0-9_.\-]+", r"(?:\[CALL_ID\][A-Za-z0-9]+)?(?:\[ARGS\])?"
_MS_HEAD = re.compile(f"({_MS_NAME}){_MS_TAGS}")


def _mistral_id() -> str:
    # Mistral's templates and mistral_common want ids of 9 letters or digits
    return "".join(random.choices(_ALNUM, k=9))


def _mistral_calls(block: str, tools=None) -> Optional[list]:
    """A ``[TOOL_CALLS]`` block: a JSON list of calls, or one call's name and arguments."""
    rest = block[len(_MARK):].strip()
    if rest.startswith("["):
        try:
            items = json.loads(rest)
        except (ValueError, RecursionError):
            return None
        pairs = [(o.get("name"), o.get("arguments", o.get("parameters", {}))) if isinstance(o, dict) else (None, None)
                 for o in items] if isinstance(items, list) and items else [(None, None)]
    else:
        brace = rest.find("{")
        head = _MS_HEAD.fullmatch(rest[:brace].rstrip()) if brace > 0 else None
        try:
            pairs = [(head.group(1), json.loads(rest[brace:]))] if head else [(None, None)]
        except (ValueError, RecursionError):
            return None
    calls = [tool_call(n, a, _mistral_id()) if isinstance(a, dict) else None for n, a in pairs]
    return calls if all(calls) else None


def _mistral_maybe(tail: str) -> bool:
    """The marker begun, or the marker and a name (and the markers after it) so far."""
    return _held_tail(tail, _MARK) == len(tail) or re.fullmatch(r"\[TOOL_CALLS\][\s\w.\-\[\]]*", tail) is not None


MISTRAL = BracketFormat(re.compile(r"\[TOOL_CALLS\]\s*(?:\[|" + _MS_NAME + _MS_TAGS + r"\s*\{)"), "[", _mistral_maybe,
                        _mistral_calls, '"', special_tokens=True)
