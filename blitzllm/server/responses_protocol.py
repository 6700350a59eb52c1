"""The body of ``POST /v1/responses`` (OpenAI's Responses API, as ``openai.types.responses``
spells it) as strict pydantic models, like ``protocol.py``'s: its input items, flat function
tools, tool choice and text format; and the models of what the server answers (the response
object, its output items, its stream events), which the OpenAPI document and the tests use.
The endpoint itself is ``responses.py``."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, RootModel

from .protocol import Int, SamplingFields, TokenLogprob, _Out, _Strict, by_type, text_or_list

# OpenAI's include values (ResponseIncludable); only the logprobs one changes the answer
INCLUDABLE = Literal["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                     "message.input_image.image_url", "computer_call_output.output.image_url",
                     "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs"]
LOGPROBS = "message.output_text.logprobs"


class TextPart(_Strict):
    """A text part of an input message (``input_text``, or an earlier answer's ``output_text``),
    of a function call's output, or of a reasoning item's content / summary; or an input
    message's ``input_image`` (for a vision model)."""
    type: str
    text: Optional[str] = None
    image_url: Optional[str] = None   # input_image: a data URL or an http(s) URL


class MessageItem(_Strict):
    type: Optional[Literal["message"]] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[TextPart]]
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallItem(_Strict):
    """An earlier answer's call: an assistant turn's tool call for the chat template."""
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutputItem(_Strict):
    """A call's result: a ``tool`` message for the chat template."""
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Union[str, list[TextPart]]
    id: Optional[str] = None
    status: Optional[str] = None


class ReasoningItem(_Strict):
    """An earlier answer's reasoning: the assistant turn's ``reasoning_content`` for the template."""
    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: list[TextPart] = []
    content: Optional[list[TextPart]] = None
    encrypted_content: Optional[str] = None
    status: Optional[str] = None


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
InputItem = by_type({"message": MessageItem, "function_call": FunctionCallItem,
                     "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem},
                    f"an input item's type must be one of {', '.join(ITEM_TYPES)} (a message when absent)",
                    default="message")
Input = text_or_list(InputItem)


class FunctionTool(_Strict):
    """Responses' flat function tool (other tool types are not served)."""
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(_Strict):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None


class ReasoningConfig(_Strict):
    effort: Optional[str] = Field(None, description="handed to the chat template as reasoning_effort")
    summary: Optional[str] = None
    generate_summary: Optional[str] = None


Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]


class ResponsesRequest(SamplingFields):
    input: Input
    instructions: Optional[str] = Field(None, description="a system message before the input")
    max_output_tokens: Optional[Int] = Field(None, ge=1)
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Union[Literal["auto", "none", "required"], ToolChoiceFunction, None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    store: Optional[bool] = Field(True, description="keep the response for previous_response_id and GET "
                                                    "(in memory, bounded: --max-stored-responses)")
    previous_response_id: Optional[str] = None
    metadata: Optional[Metadata] = None
    top_logprobs: Optional[Int] = Field(None, ge=0)
    include: Optional[list[INCLUDABLE]] = Field(None, description=f"{LOGPROBS}: the message's token logprobs; "
                                                "the others are accepted and have no effect")
    reasoning: Optional[ReasoningConfig] = None
    truncation: Optional[Literal["auto", "disabled"]] = Field(
        None, description="auto: the conversation's oldest turns are dropped until the prompt fits; disabled "
        "(default): a prompt too long is a 400")
    chat_template_kwargs: Optional[dict[str, Any]] = None  # (vLLM's chat extra, as chat completions take it)
    stream_options: Optional[dict[str, Any]] = None
    background: Optional[bool] = Field(None, description="not supported: true is a 400")
    conversation: Union[str, dict[str, Any], None] = Field(None, description="not supported: a 400")
    prompt: Optional[dict[str, Any]] = Field(None, description="not supported (stored prompts): a 400")


# ---- responses (the OpenAPI schema's; responses.py builds them as dicts) --------------------------
Status = Literal["completed", "incomplete", "in_progress"]


class OutputText(_Out):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[TokenLogprob]


class OutputMessage(_Out):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Status
    content: list[OutputText]


class ReasoningText(_Out):
    type: Literal["reasoning_text"]
    text: str


class OutputReasoning(_Out):
    id: str
    type: Literal["reasoning"]
    summary: list[Any]
    content: Optional[list[ReasoningText]] = None
    status: Status


class OutputFunctionCall(_Out):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="JSON text")
    status: Status


OutputItem = Annotated[Union[OutputMessage, OutputReasoning, OutputFunctionCall], Field(discriminator="type")]


class InputTokensDetails(_Out):
    cached_tokens: int = Field(description="prompt tokens the prefix cache served")
    cache_write_tokens: int = Field(description="always 0: the prefix cache has no explicit writes")


class OutputTokensDetails(_Out):
    reasoning_tokens: int


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Out):
    """The response (``openai.types.responses.Response``), with the request's settings echoed."""
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    background: bool
    error: None
    incomplete_details: Optional[IncompleteDetails]
    instructions: Optional[str]
    max_output_tokens: Optional[int]
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: Optional[str]
    reasoning: Optional[dict[str, Any]]
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: Union[str, dict[str, Any]]
    tools: list[dict[str, Any]]
    top_logprobs: Optional[int]
    top_p: float
    truncation: str
    usage: Optional[ResponseUsage]
    user: Optional[str]
    metadata: Optional[dict[str, str]]


class DeletedResponse(_Out):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class _Event(_Out):
    sequence_number: int


class LifecycleEvent(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    response: ResponseObject


class ItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class PartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: Union[OutputText, ReasoningText]


class DeltaLogprob(_Out):
    token: str
    logprob: float
    top_logprobs: list[dict[str, Any]] = Field(description="{token, logprob} each")


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[DeltaLogprob]


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[DeltaLogprob]


class ReasoningDeltaEvent(_Event):
    type: Literal["response.reasoning_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningDoneEvent(_Event):
    type: Literal["response.reasoning_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    arguments: str


class ErrorEvent(_Event):
    """The engine failed mid-stream (the stream ends after it)."""
    type: Literal["error"]
    code: Optional[str]
    message: str
    param: Optional[str]


class ResponseStreamEvent(RootModel):
    """One ``event:`` / ``data:`` pair of a stream (``text/event-stream``; no ``[DONE]``)."""
    root: Annotated[Union[LifecycleEvent, ItemEvent, PartEvent, TextDeltaEvent, TextDoneEvent, ReasoningDeltaEvent,
                          ReasoningDoneEvent, ArgumentsDeltaEvent, ArgumentsDoneEvent, ErrorEvent],
                    Field(union_mode="left_to_right")]
