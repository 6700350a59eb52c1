"""The bodies of ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's Messages
API, as ``anthropic.types`` spells it) as strict pydantic models, like ``protocol.py``'s: messages
of content blocks, the system prompt, custom tools, tool choice, the thinking and output
configs; and the models of what the server answers (the Message, its content blocks, its stream
events, Anthropic's error body), which the OpenAPI document and the tests use. The endpoints
are ``messages.py``."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, RootModel

from .protocol import MAX_STOP, Int, SamplingFields, _Out, _Strict, by_type, text_or_list

BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ImageBlock(_Strict):
    """An image in a user message (for a vision model): ``source`` {"type": "base64", "media_type",
    "data"} or {"type": "url", "url"}."""
    type: Literal["image"]
    source: dict[str, Any]


class ToolUseBlock(_Strict):
    """An earlier answer's tool use: an assistant turn's tool call for the chat template."""
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


ResultBlock = by_type({"text": TextBlock}, "a tool_result's content blocks must be text blocks (images, documents "
                                           "and search results are not served)")


class ToolResultBlock(_Strict):
    """A tool's result (in a user message): a ``tool`` message for the chat template."""
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Optional[text_or_list(ResultBlock)] = None
    is_error: Optional[bool] = Field(None, description="accepted; chat templates have no place for it")


class ThinkingBlock(_Strict):
    """An earlier answer's thinking: the assistant turn's ``reasoning_content`` for the template."""
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(_Strict):
    """Claude's encrypted thinking: accepted and left out (it cannot be read)."""
    type: Literal["redacted_thinking"]
    data: Optional[str] = None


ContentBlock = by_type({"text": TextBlock, "image": ImageBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
                        "thinking": ThinkingBlock, "redacted_thinking": RedactedThinkingBlock},
                       f"a content block's type must be one of {', '.join(BLOCK_TYPES)} (documents, "
                       "search results and server tools' blocks are not served)")


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: text_or_list(ContentBlock)


SystemBlock = by_type({"text": TextBlock}, "the system prompt's blocks must be text blocks")


class Tool(_Strict):
    """A custom (client) tool; Anthropic's server tools (web search, bash, text editor, ...) are not served."""
    type: Optional[Literal["custom"]] = None
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: dict[str, Any]


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = Field(None, description="type tool: the tool")
    disable_parallel_tool_use: Optional[bool] = None


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[Int] = Field(None, ge=1, description="accepted; the thinking is not cut at it")
    display: Optional[str] = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: Optional[OutputFormat] = None
    effort: Optional[str] = Field(None, description="handed to the chat template as reasoning_effort")


class Metadata(_Strict):
    user_id: Optional[str] = None


class CountTokensRequest(_Strict):
    """What makes the prompt (``/v1/messages/count_tokens`` takes this alone)."""
    model: str = Field(min_length=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: Optional[text_or_list(SystemBlock)] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[ThinkingConfig] = Field(None, description="enabled / disabled: the chat template's "
                                               "enable_thinking and thinking variables")
    output_config: Optional[OutputConfig] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # (vLLM's chat extra, as chat completions take it)


class MessagesRequest(SamplingFields, CountTokensRequest):
    """Anthropic's fields, and the sampling fields chat completions take (vLLM's extras too)."""
    model: str = Field(min_length=1)
    max_tokens: Int = Field(ge=1, description="lowered to what fits in the context")
    stop: Optional[Annotated[list[str], Field(max_length=MAX_STOP)]] = Field(None, alias="stop_sequences")
    metadata: Optional[Metadata] = None


# ---- responses (the OpenAPI schema's; messages.py builds them as dicts) ---------------------------
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]


class TextOut(_Out):
    type: Literal["text"]
    text: str


class ThinkingOut(_Out):
    type: Literal["thinking"]
    thinking: str
    signature: str = Field(description="always empty: nothing is signed")


class ToolUseOut(_Out):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ContentOut = Annotated[Union[TextOut, ThinkingOut, ToolUseOut], Field(discriminator="type")]


class MessageUsage(_Out):
    input_tokens: int = Field(description="the prompt tokens the prefix cache did not serve")
    output_tokens: int
    cache_read_input_tokens: int = Field(description="the prompt tokens the prefix cache served")
    cache_creation_input_tokens: int = Field(description="always 0: the prefix cache has no explicit writes")


class MessageObject(_Out):
    """The answer (``anthropic.types.Message``)."""
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentOut]
    stop_reason: Optional[StopReason] = Field(description="null only in a stream's message_start")
    stop_sequence: Optional[str]
    usage: MessageUsage


class TokenCount(_Out):
    input_tokens: int


class MessageStartEvent(_Out):
    type: Literal["message_start"]
    message: MessageObject


class PingEvent(_Out):
    type: Literal["ping"]


class BlockStartEvent(_Out):
    type: Literal["content_block_start"]
    index: int
    content_block: ContentOut


class TextDelta(_Out):
    type: Literal["text_delta"]
    text: str


class ThinkingDelta(_Out):
    type: Literal["thinking_delta"]
    thinking: str


class InputJsonDelta(_Out):
    type: Literal["input_json_delta"]
    partial_json: str


class BlockDeltaEvent(_Out):
    type: Literal["content_block_delta"]
    index: int
    delta: Annotated[Union[TextDelta, ThinkingDelta, InputJsonDelta], Field(discriminator="type")]


class BlockStopEvent(_Out):
    type: Literal["content_block_stop"]
    index: int


class StopDelta(_Out):
    stop_reason: StopReason
    stop_sequence: Optional[str]


class MessageDeltaEvent(_Out):
    type: Literal["message_delta"]
    delta: StopDelta
    usage: MessageUsage


class MessageStopEvent(_Out):
    type: Literal["message_stop"]


ErrorType = Literal["invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                    "request_too_large", "rate_limit_error", "api_error", "overloaded_error"]


class AnthropicErrorDetail(_Out):
    type: ErrorType
    message: str


class AnthropicError(_Out):
    """Every failure of these routes (and an ``error`` event that ends a stream)."""
    type: Literal["error"]
    error: AnthropicErrorDetail
    request_id: Optional[str] = Field(None, description="the request's X-Request-Id")


class MessageStreamEvent(RootModel):
    """One ``event:`` / ``data:`` pair of a stream (``text/event-stream``; no ``[DONE]``)."""
    root: Annotated[Union[MessageStartEvent, PingEvent, BlockStartEvent, BlockDeltaEvent, BlockStopEvent,
                          MessageDeltaEvent, MessageStopEvent, AnthropicError], Field(discriminator="type")]
