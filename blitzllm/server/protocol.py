"""Request bodies of the OpenAI-compatible API as strict pydantic models: a string where a number
belongs is a 400, unknown fields are ignored, ``null`` means the default. Responses are plain
dicts built in ``serving.py`` (cheaper per chunk).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class ContentPart(_Strict):
    type: str
    text: Optional[str] = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None                 # a tool message: the call it answers


class ResponseFormat(_Strict):
    type: str
    json_schema: Optional[dict[str, Any]] = None  # {"name": ..., "schema": {...}, "strict": ...}


class _SamplingRequest(_Strict):
    """Fields shared by chat and completions (OpenAI's plus vLLM's common extensions)."""
    model: Optional[str] = None
    n: Optional[int] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[bool] = False
    min_tokens: Optional[int] = None
    skip_special_tokens: Optional[bool] = True
    include_stop_str_in_output: Optional[bool] = False
    logit_bias: Optional[dict[str, float]] = None
    # vLLM's structured outputs: {"json": schema, "json_object": true, "regex": ..., "choice": [...],
    # "grammar": ...} (one of them), and its older guided_* fields
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # extra variables for the chat template
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    add_generation_prompt: Optional[bool] = True


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class TokenizeRequest(_Strict):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = True
    add_generation_prompt: Optional[bool] = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list] = None


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]
