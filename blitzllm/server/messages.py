"""POST /v1/messages (Anthropic's Messages API) on the chat path: the system prompt and messages
become chat messages (``messages_items.Conversation``), ``chat.prepare_turn`` renders and
configures them as a chat completion would be, one engine request runs, and its output becomes
content blocks (``messages_items.ContentBuilder``): a Message, or Anthropic's SSE event stream.
And POST /v1/messages/count_tokens: the rendered prompt's length. Errors on these routes take
Anthropic's shape (``errors.APIError.response``)."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.async_engine import EngineStepError
from .chat import prepare_turn
from .errors import bad_request
from .messages_items import ContentBuilder, Conversation, message_id
from .messages_protocol import CountTokensRequest, MessagesRequest
from .serving import Serving, SSEResponse, engine_error, request_id, typed_sse
from .vision import chat_images, expand_images
from .turn_output import feed_whole


async def create_message(s: Serving, req: MessagesRequest, raw: Request) -> Response:
    lora = s.check_model(req.model)
    conv = await s.cpu(Conversation, req)
    turn = await prepare_turn(s, req, conv.messages, tools=conv.tools, tool_choice=conv.tool_choice,
                              parallel_tool_calls=conv.parallel, structured=(conv.structured, "output_config.format"),
                              max_tokens=req.max_tokens, max_tokens_field="max_tokens", k=None, end=conv.end,
                              template_kwargs=conv.template_kwargs)
    params, n_in = turn.params, len(turn.ids)
    if n_in + params.max_tokens > s.max_model_len:  # (as Anthropic and vLLM: lowered to what fits)
        room = s.max_model_len - n_in
        # (the lowered max_tokens is checked again by SamplingParams: a min_tokens past it was a 500)
        if params.min_tokens > room:
            raise bad_request(f"min_tokens ({params.min_tokens}) is more than the {room} tokens the context "
                              f"(max_model_len={s.max_model_len}) leaves after the prompt's {n_in}",
                              param="min_tokens")
        params = params.clone(max_tokens=room)
    rid = f"msg-{request_id(raw)}"
    stream = await s.submit(rid, turn.ids, params, "messages", "max_tokens", structured_field=turn.structured_field,
                            images=turn.images, lora_request=lora, cache_salt=req.cache_salt)
    head = {"id": message_id(), "type": "message", "role": "assistant", "model": s.answer_model(lora)}
    builder = ContentBuilder(turn.parser(s))
    if req.stream:
        return SSEResponse(_events(stream, head, builder, n_in, req.max_tokens),
                           on_close=lambda: s.aengine.abort(rid, stream))
    if not await feed_whole(s, raw, stream, builder):
        return Response(status_code=499)
    return JSONResponse({**head, "content": builder.content, **builder.stop(req.max_tokens),
                         "usage": builder.usage(n_in)})


async def _events(stream, head: dict, builder: ContentBuilder, n_in: int, max_tokens: int):
    """Anthropic's stream: message_start (its usage as known before the prefix cache answers:
    the last event's usage has the split), a ping, the blocks' events, message_delta (the stop
    reason, the usage), message_stop; an engine failure ends it with an error event."""
    yield typed_sse({"type": "message_start", "message": {
        **head, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": n_in, "output_tokens": 0, "cache_read_input_tokens": 0,
                  "cache_creation_input_tokens": 0}}})
    yield typed_sse({"type": "ping"})
    try:
        async for ev in stream:
            for e in builder.feed(ev):
                yield typed_sse(e)
    except EngineStepError as e:
        yield typed_sse(engine_error(e).anthropic_body())
        return
    yield typed_sse({"type": "message_delta", "delta": builder.stop(max_tokens), "usage": builder.usage(n_in)})
    yield typed_sse({"type": "message_stop"})


async def count_tokens(s: Serving, req: CountTokensRequest) -> dict:
    """The prompt a message request with these fields would run (its ``usage.input_tokens`` +
    ``usage.cache_read_input_tokens``)."""
    s.check_model(req.model)
    conv = await s.cpu(Conversation, req)
    images = await chat_images(s, conv.messages)   # (their tokens count)
    ids, text = await s.chat_prompt(conv.messages, conv.end, conv.template_kwargs, conv.prompt_tools(),
                                    check_length=False, images=bool(images))
    return {"input_tokens": len(await expand_images(s, ids, text, images) if images else ids)}
