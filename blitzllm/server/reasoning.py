"""Reasoning outputs (``--reasoning-parser NAME``): a thinking model's ``<think>`` block as
``reasoning_content`` beside ``content``, whole or streamed, by the one open / close rule every
parser name shares (docs/serving.md#reasoning-output). Knows nothing about the engine or HTTP.
"""
from __future__ import annotations

from typing import Optional

START, END = "<think>", "</think>"
THINK_PARSERS = ("deepseek_r1", "deepseek_v3", "qwen3", "minimax_m2", "glm45")
PARSERS = THINK_PARSERS + ("minimax_m2_append_think",)


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside a ``<think>`` block it opened and did not close."""
    i = prompt_text.rfind(START)
    return i >= 0 and prompt_text.find(END, i) < 0


def _held_tail(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkSplitter:
    """One sequence's text, fed as it streams, split into (reasoning, content) pieces."""

    def __init__(self, opened: bool):
        self.state = "reasoning" if opened else "start"
        self.saw_reasoning = opened
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, content = [], []
        while self.buf:
            if self.state == "start":  # may the output still open its own block?
                s = self.buf.lstrip()
                if s.startswith(START):
                    self.buf, self.state, self.saw_reasoning = s[len(START):], "reasoning", True
                    continue
                if START.startswith(s):  # (whitespace or a partial "<think>": wait for more)
                    break
                self.state = "content"
            elif self.state == "reasoning":
                i = self.buf.find(END)
                if i >= 0:
                    reasoning.append(self.buf[:i])
                    self.buf, self.state = self.buf[i + len(END):], "content"
                    continue
                keep = _held_tail(self.buf, END)
                reasoning.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            else:
                content.append(self.buf)
                self.buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the sequence has ended: a partial tag is plain text."""
        rest, self.buf = self.buf, ""
        return (rest, "") if self.state == "reasoning" else ("", rest)


class AppendThink:
    """``minimax_m2_append_think``: everything is content, after the ``<think>`` the prompt opened."""

    saw_reasoning = False

    def __init__(self, opened: bool):
        self.prefix = START if opened else ""

    def feed(self, text: str) -> tuple[str, str]:
        out, self.prefix = self.prefix + text, ""
        return "", out

    def finish(self) -> tuple[str, str]:
        return self.feed("")


def make_splitter(parser: Optional[str], prompt_text: str):
    """The splitter of one output sequence for ``parser`` (None: no reasoning parser)."""
    if parser is None:
        return None
    if parser not in PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}; got {parser!r}")
    opened = prompt_opens_thinking(prompt_text)
    return AppendThink(opened) if parser == "minimax_m2_append_think" else ThinkSplitter(opened)


def fed(splitter, text: str, final: bool = True) -> tuple:
    """``splitter.feed(text)`` (a reasoning or tool-call splitter), with what it still held back
    when ``final`` (the sequence has ended)."""
    a, b = splitter.feed(text)
    if final:
        a2, b2 = splitter.finish()
        a, b = a + a2, b + b2
    return a, b


def split_reasoning(splitter, text: str) -> tuple[Optional[str], Optional[str]]:
    """(reasoning_content, content) of a whole output: None for a part it does not have
    (reasoning where no block was open; content where nothing followed the block)."""
    reasoning, content = fed(splitter, text)
    return (reasoning if splitter.saw_reasoning else None), (content if content or not splitter.saw_reasoning
                                                              else None)
