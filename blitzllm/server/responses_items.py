"""The Responses API's items in chat terms, both ways: a request's input items (and a stored
conversation's) as the chat messages the template renders; its flat tools, tool choice and text
format as chat completions' ``tools``, ``tool_choice`` and structured output; and the model's
output, read through the chat parsers (``chat.ChoiceParser``), as output items and the stream
events that build them. Knows nothing of the engine or HTTP beyond the 400s of bad items."""
from __future__ import annotations

import uuid
from typing import Optional

from .chat import ChoiceParser, chat_logprobs
from .errors import bad_request
from .protocol import ChatMessage
from .responses_protocol import ResponsesRequest

TEXT_PARTS = ("input_text", "output_text", "text")
_ASSISTANT_PARTS = ("content", "reasoning_content", "tool_calls")


def input_items(req: ResponsesRequest) -> list:
    """The request's input as item dicts (a string: one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return [item.model_dump(exclude_none=True) for item in req.input]


def _text(content, param: str, kinds=TEXT_PARTS) -> str:
    """A string, or text parts joined by newlines (as chat joins a message's parts)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.get("type") not in kinds or part.get("text") is None:
            raise bad_request(f"{param}.{j}: only text parts ({', '.join(kinds[:2])}) are supported, got type "
                              f"{part.get('type')!r}", param=f"{param}.{j}")
        texts.append(part["text"])
    return "\n".join(texts)


def _assistant(messages: list, part: str, value) -> None:
    """``value`` as ``part`` of the assistant turn in progress (the last message, when it is an
    assistant's without that part yet; calls join those before them), else of a new one."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and (part == "tool_calls" or last.get(part) is None):
        if part == "tool_calls":
            last[part] = (last.get(part) or []) + value
        else:
            last[part] = value
        return
    messages.append({"role": "assistant", part: value})


def chat_messages(instructions: Optional[str], earlier: list, items: list) -> list:
    """The chat messages of a conversation: ``instructions`` as a system message first, then the
    items of the earlier turns (a stored conversation, valid) and the request's ``items`` (a
    bad one is a 400 naming its place in ``input``). Function calls become an assistant turn's
    ``tool_calls``, their outputs ``tool`` messages, reasoning its ``reasoning_content``."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for i, item in enumerate(earlier + items):
        where = f"input.{i - len(earlier)}"
        kind = item.get("type") or "message"
        if kind == "message":
            text = _text(item["content"], f"{where}.content")
            if item["role"] == "assistant":
                _assistant(messages, "content", text)
            else:
                messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            _assistant(messages, "tool_calls", [{"id": item["call_id"], "type": "function",
                                                 "function": {"name": item["name"], "arguments": item["arguments"]}}])
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item["output"], f"{where}.output")})
        elif kind == "reasoning":  # (encrypted reasoning, OpenAI's, cannot be read: left out)
            parts = item.get("content") or item.get("summary") or []
            text = "\n".join(p.get("text") or "" for p in parts)
            if text:
                _assistant(messages, "reasoning_content", text)
    if not messages:
        raise bad_request("the conversation is empty: give input (or instructions)", param="input")
    return [ChatMessage(**m) for m in messages]


def chat_tools(tools) -> Optional[list]:
    """Flat function tools as chat completions' (None for none: an empty list is no tools)."""
    if not tools:
        return None
    return [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in tools]


def chat_tool_choice(choice, tools) -> object:
    """Responses' tool choice as chat completions' ("auto", the default, needs no tools here)."""
    if choice is None or isinstance(choice, str):
        return None if choice in (None, "auto", "none") and not tools else choice
    return {"type": "function", "function": {"name": choice.name}}


def text_format(req: ResponsesRequest) -> Optional[dict]:
    """``text.format`` as ``SamplingParams.structured_output`` (None for text)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if not isinstance(fmt.schema_, dict):
        raise bad_request("text.format json_schema needs schema (an object)", param="text.format")
    return {"type": "json_schema", "schema": fmt.schema_}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """One response's output items, built from its engine events as they come, streamed or not:
    the same events give the same items. The text goes through the chat parsers; reasoning opens
    a reasoning item, content a message (text that is only whitespace waits for more: beside
    calls and nothing else it is dropped, as chat's content is), each closed call a function
    call item. ``feed`` returns the stream events (without their sequence numbers). ``k``: top
    logprobs of the message's tokens (None: no logprobs)."""

    def __init__(self, s, parser: ChoiceParser, k: Optional[int]):
        self.s, self.parser, self.k = s, parser, k
        self.items: list = []           # output items, in order; an open one is replaced when it closes
        self.open: Optional[dict] = None  # the open item's state: kind, index, id, text, logprobs
        self.held = ""                  # whitespace content that no message holds yet
        self.pending: list = []         # logprobs of tokens whose text has not come out yet
        self.calls = 0
        self.output_tokens = self.reasoning_tokens = 0
        self.finish_reason: Optional[str] = None
        self.cached_tokens = 0

    def feed(self, ev) -> list:
        final = ev.finish_reason is not None
        delta = self.parser.delta(ev.text, final)
        reasoning, content, calls = (delta.get("reasoning_content"), delta.get("content"),
                                     delta.get("tool_calls") or [])
        out = []
        n = len(ev.new_token_ids)
        self.output_tokens += n
        if self.k is not None:
            self.pending += chat_logprobs(self.s, ev.new_token_ids, ev.logprobs, self.k)
        if reasoning:
            out += self._switch("reasoning")
            self.open["text"].append(reasoning)
            out.append(self._event_of(self.open, "response.reasoning_text.delta", delta=reasoning))
            self.pending = []   # (reasoning tokens: the message's logprobs leave them out)
        if not content and not calls and self.open is not None and self.open["kind"] == "reasoning":
            self.reasoning_tokens += n
        if content:
            out += self._content(content)
        for call in calls:
            out += self._close("completed")
            out += self._call(call)
        if final:
            self.finish_reason, self.cached_tokens = ev.finish_reason, ev.num_cached_tokens or 0
            status = "incomplete" if ev.finish_reason == "length" else "completed"
            if self.held and not self.calls:
                out += self._content("")
            if not self.items:  # (nothing at all: an empty message)
                out += self._switch("message")
            out += self._close(status)
        return out

    def _content(self, text: str) -> list:
        out = []
        if self.open is None or self.open["kind"] != "message":
            if text and not text.strip():
                self.held += text
                return out
            out += self._switch("message")
            text, self.held = self.held + text, ""
        self.open["text"].append(text)
        self.open["lps"] += self.pending
        out.append(self._event_of(self.open, "response.output_text.delta", delta=text,
                                    logprobs=[_delta_logprob(lp) for lp in self.pending]))
        self.pending = []
        return out

    def _switch(self, kind: str) -> list:
        """Close the open item unless it is a ``kind`` one, and open one."""
        if self.open is not None and self.open["kind"] == kind:
            return []
        out = self._close("completed")
        index, item_id = len(self.items), _id("msg" if kind == "message" else "rs")
        self.open = {"kind": kind, "index": index, "id": item_id, "text": [], "lps": []}
        if kind == "message":
            item = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": item_id, "type": "reasoning", "summary": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        return out + [{"type": "response.output_item.added", "output_index": index, "item": dict(item)},
                      self._event_of(self.open, "response.content_part.added", part=part)]

    def _close(self, status: str) -> list:
        o = self.open
        if o is None:
            return []
        self.open, text = None, "".join(o["text"])
        if o["kind"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": o["lps"]}
            item = {"id": o["id"], "type": "message", "role": "assistant", "status": status, "content": [part]}
            done = self._event_of(o, "response.output_text.done", text=text,
                                  logprobs=[_delta_logprob(lp) for lp in o["lps"]])
        else:
            part = {"type": "reasoning_text", "text": text}
            item = {"id": o["id"], "type": "reasoning", "summary": [], "content": [part], "status": status}
            done = self._event_of(o, "response.reasoning_text.done", text=text)
        self.items[o["index"]] = item
        return [done, self._event_of(o, "response.content_part.done", part=part),
                {"type": "response.output_item.done", "output_index": o["index"], "item": item}]

    @staticmethod
    def _event_of(o: dict, kind: str, **fields) -> dict:
        return {"type": kind, "item_id": o["id"], "output_index": o["index"], "content_index": 0, **fields}

    def _call(self, call: dict) -> list:
        index, fn = len(self.items), call["function"]
        item = {"id": _id("fc"), "type": "function_call", "call_id": call["id"], "name": fn["name"],
                "arguments": fn["arguments"], "status": "completed"}
        self.items.append(item)
        self.calls += 1
        at = {"item_id": item["id"], "output_index": index}
        return [{"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "arguments": "", "status": "in_progress"}},
                {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"]},
                {"type": "response.output_item.done", "output_index": index, "item": item}]


def _delta_logprob(lp: dict) -> dict:
    """A stream event's logprob: the output_text's without the bytes."""
    return {"token": lp["token"], "logprob": lp["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in lp["top_logprobs"]]}
