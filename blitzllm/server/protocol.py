"""Request bodies of the OpenAI-compatible API as strict pydantic models: a string where a number
belongs is a 400, unknown fields are ignored, ``null`` means the default. Responses are plain
dicts built in ``serving.py`` (cheaper per chunk); the response models at the end describe them
for the OpenAPI schema (``/openapi.json``), and the tests check real responses against them.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

from ..sampling_params import MAX_N

MAX_STOP = 32    # the most stop strings
MAX_EMBED_INPUTS = 2048   # the most inputs of one embeddings request (OpenAI's bound)


def _whole(v):
    """JSON Schema's integer: a number with no fraction, so 13.0 is 13 (13.5 and "13" stay errors)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = Annotated[int, BeforeValidator(_whole)]
TokenId = Annotated[int, BeforeValidator(_whole), Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def by_type(members: dict, message: str, default: Optional[str] = None):
    """A union of request models picked by their ``type`` field (``default`` where it is absent),
    so a bad one's errors name its own fields; an unknown type is one error, ``message``. The tags
    carry ``item:``, which ``errors._loc`` leaves out of the field path it reports."""
    def tag(v) -> str:
        kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
        return f"item:{kind or default}"

    return Annotated[Union[tuple(Annotated[m, Tag(f"item:{k}")] for k, m in members.items())],
                     Discriminator(tag, custom_error_type="invalid_item", custom_error_message=message)]


def text_or_list(item):
    """A string or a list of ``item`` (only that member is tried for a list, so its errors name
    the item's field)."""
    return Annotated[Union[Annotated[str, Tag("str")], Annotated[list[item], Tag("list[item]")]],
                     Discriminator(lambda v: "str" if isinstance(v, str) else "list[item]")]


class StreamOptions(_Strict):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class ContentPart(_Strict):
    type: str
    text: Optional[str] = None
    image_url: Union[str, dict[str, Any], None] = None   # {"url": "data:image/png;base64,..." or http(s)}
    video_url: Union[str, dict[str, Any], None] = None   # vLLM's: {"url": "data:video/mp4;base64,..." or http(s)}


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None                 # a tool message: the call it answers
    reasoning_content: Optional[str] = None            # an assistant's earlier thinking, for the template


class ResponseFormat(_Strict):
    type: str
    json_schema: Optional[dict[str, Any]] = None  # {"name": ..., "schema": {...}, "strict": ...}
    # vLLM's structural_tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}, or xgrammar's "format"
    structures: Optional[list[Any]] = None
    triggers: Optional[list[Any]] = None
    format: Optional[dict[str, Any]] = None


def priority_field():
    """vLLM's ``priority`` request field (generations and pooling requests): the engine checks it."""
    return Field(0, ge=-2**63 + 1, le=2**63 - 1, description="vLLM's: lower is served first (with "
                 "--scheduling-policy priority; other than 0 it is refused under fcfs)")


class SamplingFields(_Strict):
    """Sampling fields shared by chat, completions and responses (OpenAI's plus vLLM's common
    extensions). The bounds are SamplingParams' (they are checked there too), stated here for the
    OpenAPI schema."""
    model: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[Int] = Field(None, ge=-1, description="0 or -1: no top-k")
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[Int] = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=10)
    stop: Union[str, list[str], None] = Field(None, description=f"at most {MAX_STOP} strings")
    stop_token_ids: Optional[list[TokenId]] = None
    ignore_eos: Optional[bool] = False
    min_tokens: Optional[Int] = Field(None, ge=0)
    skip_special_tokens: Optional[bool] = True
    include_stop_str_in_output: Optional[bool] = False
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100, le=100)]]] = Field(
        None, description="token id (a decimal string) -> a bias in [-100, 100] added to its logit")
    allowed_token_ids: Optional[Annotated[list[TokenId], Field(min_length=1)]] = Field(
        None, description="only these tokens may be sampled")
    bad_words: Optional[list[str]] = Field(None, description="words the answer does not spell (as the tokenizer "
                                           "spells them, alone or after a space)")
    # vLLM's structured outputs: {"json": schema, "json_object": true, "regex": ..., "choice": [...],
    # "grammar": ...} (one of them), and its older guided_* fields
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    stream: Optional[bool] = False
    user: Optional[str] = None
    priority: Optional[Int] = priority_field()
    cache_salt: Optional[str] = Field(None, min_length=1, description="vLLM's: the prefix cache shares KV only "
                                      "between requests of the same salt (a long random string per tenant)")


class _SamplingRequest(SamplingFields):
    """Fields shared by chat and completions."""
    n: Optional[Int] = Field(None, ge=1, le=MAX_N)
    max_tokens: Optional[Int] = Field(None, ge=1)
    stream_options: Optional[StreamOptions] = None
    truncate_prompt_tokens: Optional[Int] = Field(None, ge=-1, description="keep the prompt's last k tokens "
                                                  "(-1: max_model_len); 0 is refused")
    # vLLM's beam search: n beams wide, ranked by cum_logprob / length ** length_penalty (server/beam.py)
    use_beam_search: Optional[bool] = False
    length_penalty: Optional[float] = Field(None, ge=-10, le=10, description="with use_beam_search (default 1.0)")
    # disaggregation (docs/disaggregation.md): {"do_remote_decode": true} to a producer; its answer's
    # kv_transfer_params to a consumer
    kv_transfer_params: Optional[dict[str, Any]] = None


PROMPT_LOGPROBS = ("vLLM's: per prompt token (the first has none: null) its logprob and rank and the top-N's; "
                   "0: the token's alone; not with stream (but 0)")
REQUEST_TEMPLATE = ("a Jinja chat template in place of the model's (vLLM's): only with the server's "
                    "--trust-request-chat-template, else a 400")
AS_TOKEN_IDS = "vLLM's: logprobs' tokens as 'token_id:<id>' (null: the server's --return-tokens-as-token-ids)"


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[Int] = Field(None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[Int] = Field(None, ge=0)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # extra variables for the chat template
    chat_template: Optional[str] = Field(None, description=REQUEST_TEMPLATE)
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = Field(False, description="the final (assistant) message left open for "
                                                   "the model to continue; needs add_generation_prompt false")
    prompt_logprobs: Optional[Int] = Field(None, ge=0, description=PROMPT_LOGPROBS + " (the rendered prompt's)")
    return_tokens_as_token_ids: Optional[bool] = Field(None, description=AS_TOKEN_IDS)


class CompletionRequest(_SamplingRequest):
    # exactly one of prompt and prompt_embeds, as the route checks
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"oneOf": [
        {"required": ["prompt"], "not": {"required": ["prompt_embeds"]}},
        {"required": ["prompt_embeds"], "not": {"required": ["prompt"]}}]})
    prompt: Union[Text, TokenIds, Annotated[list[Text], Field(min_length=1)],
                  Annotated[list[TokenIds], Field(min_length=1)], None] = None
    prompt_embeds: Union[str, Annotated[list[str], Field(min_length=1)], None] = Field(
        None, description="vLLM's, in place of prompt (with --enable-prompt-embeds): base64 of torch.save'd "
                          "[num_tokens, hidden_size] tensors")
    max_tokens: Optional[Int] = Field(None, ge=0, description="0 (with echo): score the prompt, generate nothing")
    echo: Optional[bool] = False
    logprobs: Optional[Int] = Field(None, ge=0, description="with echo, the prompt tokens' too")
    suffix: Optional[str] = None
    best_of: Optional[Int] = None
    prompt_logprobs: Optional[Int] = Field(None, ge=0, description=PROMPT_LOGPROBS)
    return_tokens_as_token_ids: Optional[bool] = Field(None, description=AS_TOKEN_IDS)


class TokenizeRequest(_Strict):
    # exactly one of prompt (a string) and messages (a list), as the route checks
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = True
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    chat_template: Optional[str] = Field(None, description=REQUEST_TEMPLATE)
    tools: Optional[list] = None


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[TokenId]


# a pooling request's ``input`` (embeddings, /classify): a text, token ids, or a list of either
PoolingInputs = Union[Text, TokenIds, Annotated[list[Text], Field(min_length=1, max_length=MAX_EMBED_INPUTS)],
                      Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBED_INPUTS)]]


class PoolingFields(_Strict):
    """What every pooling request shares (embeddings, score, rerank, /classify)."""
    model: Optional[str] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[Int] = Field(None, ge=-1, description="keep each input's last k tokens "
                                                                           "(-1: max_model_len)")
    priority: Optional[Int] = priority_field()


class _EmbeddingFields(PoolingFields):
    """What both forms of an embeddings request share (OpenAI's fields, vLLM's extras)."""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[Int] = Field(None, ge=1, description="matryoshka models only: keep the first N values")
    normalize: Optional[bool] = Field(None, description="vLLM's: L2-normalize (null: the server's "
                                                        "--pooler-config, by default true)")


class EmbeddingRequest(_EmbeddingFields):
    """OpenAI's embeddings request, with vLLM's extras (truncate_prompt_tokens, add_special_tokens,
    normalize, priority)."""
    input: PoolingInputs
    add_special_tokens: Optional[bool] = Field(True, description="vLLM's: the tokenizer's special tokens "
                                                                 "around a text input (a BOS)")


class EmbeddingChatRequest(_EmbeddingFields):
    """vLLM's chat form of an embeddings request: one vector of ``messages`` rendered by the
    model's chat template (by default with no assistant turn opened)."""
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: Optional[bool] = Field(False, description="open an assistant turn after the messages")
    continue_final_message: Optional[bool] = Field(False, description="the final message left open; needs "
                                                   "add_generation_prompt false")
    add_special_tokens: Optional[bool] = Field(False, description="the tokenizer's special tokens (a BOS) on top "
                                               "of what the chat template writes")
    chat_template: Optional[str] = Field(None, description=REQUEST_TEMPLATE)
    chat_template_kwargs: Optional[dict[str, Any]] = None  # extra variables for the chat template


Texts = Union[Text, Annotated[list[Text], Field(min_length=1, max_length=MAX_EMBED_INPUTS)]]


class ScoreRequest(PoolingFields):
    """vLLM's /v1/score: text_1 against each text_2 (one text_1), or pairwise (as many of each)."""
    text_1: Texts
    text_2: Texts


class RerankRequest(PoolingFields):
    """vLLM's /v1/rerank (Jina's and Cohere's request)."""
    query: Text
    documents: Annotated[list[Text], Field(min_length=1, max_length=MAX_EMBED_INPUTS)]
    top_n: Optional[Int] = Field(None, ge=0, description="the best N (0 or null: every document)")


# ---- responses (the OpenAPI schema's; serving.py builds them as dicts) ---------------------------
class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Out):
    cached_tokens: int   # prompt tokens the prefix cache served


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None   # (--enable-prompt-tokens-details)


class FunctionCall(_Out):
    name: str
    arguments: str  # JSON text


class ToolCall(_Out):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ToolCallDelta(ToolCall):
    index: int


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprob]


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: Optional[str]
    reasoning_content: Optional[str] = Field(None, description="with --reasoning-parser")
    tool_calls: Optional[list[ToolCall]] = None


class PromptLogprob(_Out):
    logprob: float
    rank: int = Field(description="1 for the most likely token; a prompt token outside the top-N: the number of "
                                  "vocabulary entries whose logprob is >= its own")
    decoded_token: str


# vLLM's prompt_logprobs: one entry per prompt token, null for the first, then {token id (a decimal
# string): PromptLogprob} of the prompt token and the top-N
PromptLogprobs = Optional[list[Optional[dict[str, PromptLogprob]]]]


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: Optional[str] = Field(description="stop, length, tool_calls or abort")
    stop_reason: Union[int, str, None] = Field(description="the stop string or token id that ended the choice")


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs = Field(None, description="with the request's prompt_logprobs: the rendered "
                                                               "prompt's")
    kv_transfer_params: Optional[dict[str, Any]] = None  # a producer's: where the prefilled KV waits


class ChatDelta(_Out):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs]
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None] = None


class ChatCompletionChunk(_Out):
    """One ``data:`` event of a stream (``text/event-stream``, ended by ``data: [DONE]``)."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class CompletionLogprobs(_Out):
    """The legacy format: parallel lists, one entry per token (a prompt's first token, echoed, has
    no logprob: null)."""
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Optional[str] = Field(description="stop, length or abort")
    stop_reason: Union[int, str, None] = None
    prompt_logprobs: PromptLogprobs = Field(None, description="with the request's prompt_logprobs: the choice's "
                                                               "prompt's (not in a stream)")


class CompletionResponse(_Out):
    """Also each ``data:`` event of a stream (then ``usage`` only where asked for)."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    kv_transfer_params: Optional[dict[str, Any]] = None  # a producer's: where the prefilled KV waits


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: Optional[int] = Field(None, description="once the model has loaded")
    vocab_size: Optional[int] = Field(None, description="once the model has loaded")
    root: Optional[str] = Field(None, description="a LoRA adapter's: its folder")
    parent: Optional[str] = Field(None, description="a LoRA adapter's: the base model's id")


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Out):
    count: int
    max_model_len: int
    tokens: list[int]


class Embedding(_Out):
    object: Literal["embedding"]
    embedding: Union[list[float], str] = Field(description="floats, or with encoding_format base64 their "
                                                           "little-endian float32 bytes in base64")
    index: int


class EmbeddingUsage(_Out):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Out):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


class Score(_Out):
    index: int
    object: Literal["score"]
    score: float = Field(description="the cosine similarity of the two texts' embeddings, or a cross-encoder's "
                                     "score of the pair")


class ScoreResponse(_Out):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Score]
    usage: EmbeddingUsage


class RerankDocument(_Out):
    text: str


class RerankResult(_Out):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(_Out):
    total_tokens: int


class RerankResponse(_Out):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult] = Field(description="by relevance, the most relevant first")


class DetokenizeResponse(_Out):
    prompt: str


class HealthResponse(_Out):
    status: Literal["ok"]


class VersionResponse(_Out):
    version: str


class ResetPrefixCacheResponse(_Out):
    reset: bool   # false: a request held KV blocks, nothing was done


class ErrorDetail(_Out):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(_Out):
    error: ErrorDetail
