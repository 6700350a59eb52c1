"""The Responses API's items in chat terms, both ways: a request's input items (and a stored
conversation's) as the chat messages the template renders; its flat tools, tool choice and text
format as chat completions' ``tools``, ``tool_choice`` and structured output; and the model's
output, read through the chat parsers (``chat.ChoiceParser``), as output items and the stream
events that build them. Knows nothing of the engine or HTTP beyond the 400s of bad items."""
from __future__ import annotations

import uuid
from typing import Optional

from .chat import ChoiceParser, chat_logprobs
from .chat_template import add_assistant_part
from .errors import bad_request
from .protocol import ChatMessage
from .responses_protocol import ResponsesRequest
from .turn_output import BlockSequence

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


def _has_image(content) -> bool:
    return isinstance(content, list) and any(p.get("type") == "input_image" for p in content)


def _parts(content: list, param: str, vision: bool) -> list:
    """An input message's text and ``input_image`` parts as chat content parts (``image_url``)."""
    out = []
    for j, part in enumerate(content):
        if part.get("type") == "input_image":
            if not vision:
                raise bad_request(f"{param}.{j}: this model takes no images (it has no vision tower)",
                                  param=f"{param}.{j}")
            if not part.get("image_url"):
                raise bad_request(f"{param}.{j}: an input_image needs image_url (file_id is not supported)",
                                  param=f"{param}.{j}")
            out.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif part.get("type") in TEXT_PARTS and part.get("text") is not None:
            out.append({"type": "text", "text": part["text"]})
        else:
            raise bad_request(f"{param}.{j}: only text and input_image parts are supported, got type "
                              f"{part.get('type')!r}", param=f"{param}.{j}")
    return out


def chat_messages(instructions: Optional[str], earlier: list, items: list, vision: bool = False) -> list:
    """The chat messages of a conversation: ``instructions`` as a system message first, then the
    items of the earlier turns (a stored conversation, valid) and the request's ``items`` (a
    bad one is a 400 naming its place in ``input``). Function calls become an assistant turn's
    ``tool_calls``, their outputs ``tool`` messages, reasoning its ``reasoning_content``; a user's
    ``input_image`` parts chat's ``image_url`` parts (``vision``: the model has a vision tower)."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for i, item in enumerate(earlier + items):
        where = f"input.{i - len(earlier)}"
        kind = item.get("type") or "message"
        if kind == "message":
            if item["role"] != "assistant" and _has_image(item["content"]):
                messages.append({"role": item["role"], "content": _parts(item["content"], f"{where}.content", vision)})
                continue
            text = _text(item["content"], f"{where}.content")
            if item["role"] == "assistant":
                add_assistant_part(messages, "content", text)
            else:
                messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            add_assistant_part(messages, "tool_calls", [{"id": item["call_id"], "type": "function",
                                                 "function": {"name": item["name"], "arguments": item["arguments"]}}])
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item["output"], f"{where}.output")})
        elif kind == "reasoning":  # (encrypted reasoning, OpenAI's, cannot be read: left out)
            parts = item.get("content") or item.get("summary") or []
            text = "\n".join(p.get("text") or "" for p in parts)
            if text:
                add_assistant_part(messages, "reasoning_content", text)
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


class OutputBuilder(BlockSequence):
    """One response's output items (``turn_output.BlockSequence``): reasoning opens a reasoning
    item, content a message, each call a function call item; an output with nothing at all is
    an empty message. ``feed`` returns the stream events (without their sequence numbers).
    ``k``: top logprobs of the message's tokens (None: no logprobs)."""

    EMPTY_TEXT = True

    def __init__(self, s, parser: ChoiceParser, k: Optional[int]):
        super().__init__(parser)
        self.s, self.k = s, k
        self.items: list = []           # output items, in order; an open one is replaced when it closes
        self.item: Optional[dict] = None  # the open item's state: index, id, text, logprobs
        self.pending: list = []         # logprobs of tokens whose text has not come out yet

    def feed(self, ev) -> list:
        if self.k is not None:
            self.pending += chat_logprobs(self.s, ev.new_token_ids, ev.logprobs, self.k)
        return super().feed(ev)

    def open_block(self, kind: str) -> list:
        index, item_id = len(self.items), _id("msg" if kind == "text" else "rs")
        self.item = {"index": index, "id": item_id, "text": [], "lps": []}
        if kind == "text":
            item = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": item_id, "type": "reasoning", "summary": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        return [{"type": "response.output_item.added", "output_index": index, "item": dict(item)},
                self._event_of(self.item, "response.content_part.added", part=part)]

    def grow_block(self, kind: str, text: str) -> list:
        o = self.item
        o["text"].append(text)
        if kind == "reasoning":
            self.pending = []   # (reasoning tokens: the message's logprobs leave them out)
            return [self._event_of(o, "response.reasoning_text.delta", delta=text)]
        o["lps"] += self.pending
        event = self._event_of(o, "response.output_text.delta", delta=text,
                               logprobs=[_delta_logprob(lp) for lp in self.pending])
        self.pending = []
        return [event]

    def close_block(self) -> list:
        o, status = self.item, "incomplete" if self.finish_reason == "length" else "completed"
        self.item, text = None, "".join(o["text"])
        if self.kind == "text":
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

    def add_call(self, call: dict) -> list:
        index, fn = len(self.items), call["function"]
        item = {"id": _id("fc"), "type": "function_call", "call_id": call["id"], "name": fn["name"],
                "arguments": fn["arguments"], "status": "completed"}
        self.items.append(item)
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
