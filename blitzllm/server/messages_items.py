"""The Messages API in chat terms, both ways: a request's system prompt and messages (text,
tool_use, tool_result and thinking blocks) as the chat messages the template renders, and its
custom tools, tool choice, thinking and output configs as chat completions' tools, tool_choice,
chat_template_kwargs and structured output (``Conversation``); the model's output, read through
the chat parsers, as content blocks (thinking, text, tool_use) and the stream events that build
them (``ContentBuilder``), with Anthropic's stop reason and usage. Knows nothing of the engine
or HTTP beyond the 400s of bad blocks."""
from __future__ import annotations

import json
import uuid
from typing import Optional

from .chat_template import add_assistant_part, prompt_end
from .errors import bad_request
from .messages_protocol import CountTokensRequest
from .protocol import ChatMessage
from .turn_output import BlockSequence

# Claude Code's first system block: a per-request hash that would defeat the prefix cache (vLLM drops it too)
BILLING_HEADER = "x-anthropic-billing-header"


def _joined(content) -> str:
    """A string, or text blocks joined by newlines (as chat joins a message's parts)."""
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


class Conversation:
    """A request's prompt in chat terms: ``messages`` (``ChatMessage``s), ``end`` (a final
    assistant message is continued, Anthropic's prefill), ``tools``, ``tool_choice``,
    ``parallel`` (False: one call at most), ``template_kwargs`` and ``structured`` (the output
    format's structured output). Built in a worker thread; a bad block is a 400 naming it."""

    def __init__(self, req: CountTokensRequest):
        messages = []
        system = req.system if isinstance(req.system, str) else \
            [b for b in req.system or () if not b.text.startswith(BILLING_HEADER)]
        if system:
            messages.append({"role": "system", "content": _joined(system)})
        for i, m in enumerate(req.messages):
            if m.role == "user":
                _user(messages, m.content, f"messages.{i}.content")
            else:
                _assistant(messages, m.content, f"messages.{i}.content")
        prefill = messages[-1]["role"] == "assistant"
        self.messages = [ChatMessage(**m) for m in messages]
        self.end = prompt_end(not prefill, prefill)
        self.tools = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description is not None else {}),
            "parameters": t.input_schema}} for t in req.tools or ()] or None
        self.tool_choice, self.parallel = _tool_choice(req.tool_choice, self.tools)
        kwargs = dict(req.chat_template_kwargs or {})
        if req.thinking is not None and req.thinking.type != "adaptive":
            on = req.thinking.type == "enabled"   # (Qwen3's and DeepSeek-V3.1's names for it)
            kwargs.setdefault("enable_thinking", on)
            kwargs.setdefault("thinking", on)
        config = req.output_config
        if config is not None and config.effort is not None:
            kwargs.setdefault("reasoning_effort", config.effort)  # (as vLLM hands it to the template)
        self.template_kwargs = kwargs or None
        fmt = config.format if config is not None else None
        self.structured = {"type": "json_schema", "schema": fmt.schema_} if fmt is not None else None

    def prompt_tools(self) -> Optional[list]:
        """The tools the template renders (tool_choice none leaves them out, as chat's does)."""
        return None if self.tool_choice == "none" else self.tools


def _user(messages: list, content, where: str) -> None:
    """Text and image blocks as user messages (consecutive ones joined; images as chat's
    ``image_url`` parts), tool results as tool messages, in order."""
    if isinstance(content, str):
        messages.append({"role": "user", "content": content})
        return
    parts: list = []

    def flush():
        images = any(p["type"] == "image_url" for p in parts)
        messages.append({"role": "user", "content": list(parts) if images else "\n".join(p["text"] for p in parts)})
        parts.clear()

    for j, block in enumerate(content):
        if block.type in ("text", "image"):
            parts.append({"type": "text", "text": block.text} if block.type == "text" else
                         {"type": "image_url", "image_url": {"url": _image_url(block.source, f"{where}.{j}")}})
            continue
        if block.type != "tool_result":
            raise bad_request(f"{where}.{j}: a user message takes text, image and tool_result blocks, got "
                              f"{block.type!r}", param=f"{where}.{j}")
        if parts:
            flush()
        messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _joined(block.content or "")})
    if parts or not content:
        flush()


def _image_url(source: dict, where: str) -> str:
    """An image block's source as a URL: base64 data as a data URL, or the given url."""
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise bad_request(f"{where}.source: an image source is {{type: base64, media_type, data}} or {{type: url, url}}",
                      param=f"{where}.source")


def _assistant(messages: list, content, where: str) -> None:
    """An assistant turn: its thinking as ``reasoning_content``, its text as content, its tool
    uses as ``tool_calls`` (consecutive assistant messages make one turn, as Anthropic's API
    combines them)."""
    if isinstance(content, str):
        add_assistant_part(messages, "content", content)
        return
    thinking, texts, calls = [], [], []
    for j, block in enumerate(content):
        if block.type == "thinking":
            thinking.append(block.thinking)
        elif block.type == "text":
            texts.append(block.text)
        elif block.type == "tool_use":
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif block.type == "tool_result":
            raise bad_request(f"{where}.{j}: tool_result blocks go in a user message", param=f"{where}.{j}")
    for part, value in (("reasoning_content", "\n".join(thinking) if thinking else None),
                        ("content", "\n".join(texts) if texts or not (thinking or calls) else None),
                        ("tool_calls", calls or None)):
        if value is not None:
            add_assistant_part(messages, part, value)


def _tool_choice(choice, tools) -> tuple:
    """(chat's tool_choice, parallel_tool_calls) of Anthropic's."""
    if choice is None or choice.type in ("auto", "none") and not tools:
        return None, None
    if not tools:
        raise bad_request(f"tool_choice {choice.type!r} needs tools", param="tool_choice")
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if choice.name not in [t["function"]["name"] for t in tools]:
            raise bad_request(f"tool_choice.name: a tool choice of type 'tool' names one of the tools, got "
                              f"{choice.name!r}", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


# ---- the output --------------------------------------------------------------------------------
class ContentBuilder(BlockSequence):
    """A Message's content blocks (``turn_output.BlockSequence``): reasoning opens a thinking
    block (its signature empty: nothing is signed), content a text block, each call a tool_use
    block (its ``input`` the parsed arguments; streamed whole as one input_json_delta once the
    call has closed). ``feed`` returns Anthropic's stream events for them."""

    def __init__(self, parser):
        super().__init__(parser)
        self.content: list = []
        self.parts: list = []   # the open block's text pieces

    def open_block(self, kind: str) -> list:
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "reasoning" else \
            {"type": "text", "text": ""}
        self.content.append(block)
        return [{"type": "content_block_start", "index": len(self.content) - 1, "content_block": dict(block)}]

    def grow_block(self, kind: str, text: str) -> list:
        self.parts.append(text)
        delta = {"type": "thinking_delta", "thinking": text} if kind == "reasoning" else \
            {"type": "text_delta", "text": text}
        return [{"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}]

    def close_block(self) -> list:
        self.content[-1]["thinking" if self.kind == "reasoning" else "text"] = "".join(self.parts)
        self.parts = []
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def add_call(self, call: dict) -> list:
        fn, index = call["function"], len(self.content)
        # (chat's call ids are call_<hex>; Anthropic's are toolu_<...>)
        block = {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": fn["name"],
                 "input": json.loads(fn["arguments"])}
        self.content.append(block)
        return [{"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
                {"type": "content_block_delta", "index": index,
                 "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}},
                {"type": "content_block_stop", "index": index}]

    def stop(self, max_tokens: int) -> dict:
        """The finished output's ``stop_reason`` and ``stop_sequence`` (``max_tokens``: the
        request's, else the context's end stopped it)."""
        reason, sequence = "end_turn", None
        if self.finish_reason == "length":
            reason = "max_tokens" if self.output_tokens >= max_tokens else "model_context_window_exceeded"
        elif self.calls:
            reason = "tool_use"
        elif isinstance(self.stop_reason, str):
            reason, sequence = "stop_sequence", self.stop_reason
        return {"stop_reason": reason, "stop_sequence": sequence}

    def usage(self, prompt_tokens: int) -> dict:
        """Anthropic's: the prompt's tokens are input_tokens + cache_read_input_tokens."""
        cached = min(self.cached_tokens, prompt_tokens)
        return {"input_tokens": prompt_tokens - cached, "output_tokens": self.output_tokens,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"
