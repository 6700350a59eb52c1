"""A chat turn's output as a sequence of blocks, built from its engine events as they come,
streamed or not (the same events give the same blocks): the text goes through the turn's parsers
(``chat.ChoiceParser``); reasoning opens a reasoning block, content a text block (text that is
only whitespace waits for more: beside calls and nothing else it is dropped, as chat's content
is), and each closed call is a block of its own. The Responses API's output items
(``responses_items.OutputBuilder``) and the Messages API's content blocks
(``messages_items.ContentBuilder``) are two shapes of it: a subclass says how a block opens,
grows and closes, what a call becomes, and which stream events each makes."""
from __future__ import annotations

from typing import Optional


class BlockSequence:
    """``feed`` an engine event, get the stream events it makes (the subclass's hooks). Kinds
    of block: "reasoning" and "text"; calls go to ``add_call``. ``EMPTY_TEXT``: an output with
    nothing at all is one empty text block (else no block)."""

    EMPTY_TEXT = False

    def __init__(self, parser):
        self.parser = parser
        self.kind: Optional[str] = None  # the open block's kind
        self.held = ""                   # whitespace content that no text block holds yet
        self.blocks = self.calls = 0     # blocks opened (calls included), calls
        self.output_tokens = self.reasoning_tokens = 0
        self.finish_reason: Optional[str] = None
        self.stop_reason = None          # the stop string or token id that ended the output
        self.cached_tokens = 0           # prompt tokens the prefix cache served

    # ---- the hooks: each returns the stream events it makes ----
    def open_block(self, kind: str) -> list:
        raise NotImplementedError

    def grow_block(self, kind: str, text: str) -> list:
        raise NotImplementedError

    def close_block(self) -> list:
        """Closes the open block (``self.kind``; ``self.finish_reason`` is set when the output ended)."""
        raise NotImplementedError

    def add_call(self, call: dict) -> list:
        """``call``: chat's tool call (``id``, ``function`` with ``name`` and ``arguments``)."""
        raise NotImplementedError

    # ---- the sequence ----
    def feed(self, ev) -> list:
        final = ev.finish_reason is not None
        delta = self.parser.delta(ev.text, final)
        reasoning, content, calls = (delta.get("reasoning_content"), delta.get("content"),
                                     delta.get("tool_calls") or [])
        n = len(ev.new_token_ids)
        self.output_tokens += n
        out = []
        if reasoning:
            out += self._switch("reasoning")
            out += self.grow_block("reasoning", reasoning)
        if not content and not calls and self.kind == "reasoning":
            self.reasoning_tokens += n
        if content:
            out += self._text(content)
        for call in calls:
            out += self._switch(None)
            self.blocks, self.calls = self.blocks + 1, self.calls + 1
            out += self.add_call(call)
        if final:
            self.finish_reason, self.stop_reason = ev.finish_reason, ev.stop_reason
            self.cached_tokens = ev.num_cached_tokens or 0
            if self.held and not self.calls:
                out += self._text("")
            if not self.blocks and self.EMPTY_TEXT:
                out += self._switch("text")
            out += self._switch(None)
        return out

    def _text(self, text: str) -> list:
        out = []
        if self.kind != "text":
            if text and not text.strip():
                self.held += text
                return out
            out += self._switch("text")
            text, self.held = self.held + text, ""
        return out + self.grow_block("text", text)

    def _switch(self, kind: Optional[str]) -> list:
        """Close the open block unless it is a ``kind`` one, and open one (None: none)."""
        if self.kind == kind:
            return []
        out = self.close_block() if self.kind is not None else []
        self.kind = kind
        if kind is not None:
            self.blocks += 1
            out += self.open_block(kind)
        return out


async def feed_whole(s, raw, stream, builder: BlockSequence) -> bool:
    """Every event of a non-streamed request into ``builder``; False when the client went away
    first (its request aborted, as ``Serving.until_done_or_gone`` does)."""
    async def run():
        async for ev in stream:
            builder.feed(ev)
        return True

    return await s.until_done_or_gone(raw, run(), [stream]) is not None
