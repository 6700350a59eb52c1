"""POST /v1/responses (OpenAI's Responses API) on the chat path: the input items (after a stored
conversation, with ``previous_response_id``) become chat messages, ``chat.prepare_turn`` renders
and configures them as a chat completion would be, one engine request runs, and its output
becomes output items (``responses_items.OutputBuilder``): a response object, or its SSE event
stream. Also GET / DELETE / cancel of the stored responses (``responses_store.py``)."""
from __future__ import annotations

import itertools
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.async_engine import EngineStepError
from .chat import prepare_turn
from .chat_template import prompt_end
from .errors import APIError, bad_request
from .responses_items import OutputBuilder, chat_messages, chat_tool_choice, chat_tools, input_items, text_format
from .responses_protocol import LOGPROBS, ResponsesRequest
from .responses_store import ResponseStore
from .serving import Serving, SSEResponse, engine_error, pick, request_id, typed_sse
from .turn_output import feed_whole

def _unsupported(req: ResponsesRequest) -> None:
    if req.background:
        raise bad_request("background responses are not supported", param="background")
    if req.conversation is not None:
        raise bad_request("conversations are not supported: continue with previous_response_id",
                          param="conversation")
    if req.prompt is not None:
        raise bad_request("stored prompts are not supported", param="prompt")


def not_found(response_id: str, param: str = "response_id", code: str = "response_not_found") -> APIError:
    return APIError(404, f"no stored response has the id '{response_id}' (responses are kept in memory, the "
                         "least recently used dropped past --max-stored-responses)", param=param, code=code)


async def create_response(s: Serving, req: ResponsesRequest, raw: Request, store: ResponseStore) -> Response:
    lora = s.check_model(req.model)
    _unsupported(req)
    earlier = None
    if req.previous_response_id is not None:
        earlier = store.get(req.previous_response_id)
        if earlier is None:
            raise not_found(req.previous_response_id, "previous_response_id", "previous_response_not_found")
    items = input_items(req)
    vision = s.aengine.engine is not None and s.aengine.engine.image_intake is not None
    messages = await s.cpu(chat_messages, req.instructions, earlier.conversation if earlier else [], items, vision)
    s.check_logprobs(req.top_logprobs, "top_logprobs")
    k = pick(req.top_logprobs, 0) if LOGPROBS in (req.include or ()) else None
    tools = chat_tools(req.tools)
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning is not None and req.reasoning.effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning.effort)  # (as vLLM hands it to the template)
    try:
        turn = await _fitted_turn(s, req, messages, tools=tools, tool_choice=chat_tool_choice(req.tool_choice, tools),
                                  parallel_tool_calls=req.parallel_tool_calls, structured=(text_format(req), "text.format"),
                                  max_tokens=req.max_output_tokens, max_tokens_field="max_output_tokens", k=k,
                                  end=prompt_end(True, False), template_kwargs=kwargs or None)
    except APIError as e:
        if e.param == "messages":  # (the chat template's and the prompt length's errors)
            e.param = "input"
        raise
    rid = f"resp-{request_id(raw)}"
    stream = await s.submit(rid, turn.ids, turn.params, "input", "max_output_tokens",
                            structured_field=turn.structured_field, priority=req.priority, lora_request=lora,
                            images=turn.images, cache_salt=req.cache_salt)
    head = _head(s, req, turn.params, store.enabled and req.store is not False, s.answer_model(lora))
    builder = OutputBuilder(s, turn.parser(s), k)
    finish = _Finish(s, store, head, builder, len(turn.ids), earlier, items)
    if req.stream:
        return SSEResponse(_events(s, stream, head, builder, finish), on_close=lambda: s.aengine.abort(rid, stream))
    if not await feed_whole(s, raw, stream, builder):
        return Response(status_code=499)
    return JSONResponse(await finish())


async def _fitted_turn(s: Serving, req: ResponsesRequest, messages: list, **kw):
    """``prepare_turn`` of the conversation; with ``truncation: "auto"`` (OpenAI's), of its latest
    part that fits: whole turns are dropped from the start of the conversation (the leading
    system / developer messages stay; a kept part starts at a user message) until the prompt
    leaves room for ``max_output_tokens`` (a token without it). The fewest turns are dropped (a
    binary search over where the kept part starts: each try renders the template once)."""
    room = s.max_model_len - (req.max_output_tokens or 1)

    async def turn_of(part: list):
        try:
            turn = await prepare_turn(s, req, part, **kw)
        except APIError as e:
            if e.code != "context_length_exceeded":
                raise
            return None, e
        if len(turn.ids) > room:
            return None, bad_request(f"the prompt has {len(turn.ids)} tokens, more than the {room} that leave room "
                                     f"for max_output_tokens within max_model_len={s.max_model_len}",
                                     param="input", code="context_length_exceeded")
        return turn, None

    if req.truncation != "auto":
        return await prepare_turn(s, req, messages, **kw)
    whole, err = await turn_of(messages)
    if whole is not None:
        return whole
    head = next((i for i, m in enumerate(messages) if m.role not in ("system", "developer")), len(messages))
    starts = [i for i in range(head + 1, len(messages)) if messages[i].role == "user"]
    lo, hi, best = 0, len(starts) - 1, None   # the earliest start that fits: the fewest turns dropped
    while lo <= hi:
        mid = (lo + hi) // 2
        turn, _ = await turn_of(messages[:head] + messages[starts[mid]:])
        if turn is None:
            lo = mid + 1
        else:
            best, hi = turn, mid - 1
    if best is None:
        raise err
    return best


def _head(s: Serving, req: ResponsesRequest, params, stored: bool, model: str) -> dict:
    """The response object before its output: its id and the request's settings echoed."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    choice = req.tool_choice
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "background": False, "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
            "output": [], "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump(exclude_none=True) if req.reasoning is not None else None,
            "store": stored, "temperature": params.temperature,
            "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"}},
            "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str) else choice or "auto",
            "tools": [t.model_dump() for t in req.tools or ()], "top_logprobs": pick(req.top_logprobs, 0),
            "top_p": params.top_p, "truncation": req.truncation or "disabled", "usage": None, "user": req.user,
            "metadata": req.metadata or {}}


class _Finish:
    """The finished response object (stored where asked), once the builder has had every event."""

    def __init__(self, s: Serving, store: ResponseStore, head: dict, builder: OutputBuilder, prompt_tokens: int,
                 earlier, items: list):
        self.s, self.store, self.head, self.b = s, store, head, builder
        self.prompt_tokens, self.earlier, self.items = prompt_tokens, earlier, items

    async def __call__(self) -> dict:
        b, n_in = self.b, self.prompt_tokens
        status = "incomplete" if b.finish_reason == "length" else "completed"
        body = {**self.head, "status": status, "output": b.items,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "usage": {"input_tokens": n_in,
                          "input_tokens_details": {"cached_tokens": b.cached_tokens, "cache_write_tokens": 0},
                          "output_tokens": b.output_tokens,
                          "output_tokens_details": {"reasoning_tokens": b.reasoning_tokens},
                          "total_tokens": n_in + b.output_tokens}}
        if body["store"]:  # (its size counted in a worker thread: the input may be megabytes)
            entry = await self.s.cpu(self.store.entry, body, self.earlier, self.items + b.items)
            body["store"] = self.store.put(body["id"], entry)
        return body


async def _events(s: Serving, stream, head: dict, builder: OutputBuilder, finish: _Finish):
    seq = itertools.count()

    def event(e: dict) -> bytes:
        return typed_sse({**e, "sequence_number": next(seq)})

    yield event({"type": "response.created", "response": head})
    yield event({"type": "response.in_progress", "response": head})
    try:
        async for ev in stream:
            for e in builder.feed(ev):
                yield event(e)
    except EngineStepError as e:
        err = engine_error(e)
        yield event({"type": "error", "code": err.code or err.type, "message": err.message, "param": None})
        return
    body = await finish()
    yield event({"type": "response.incomplete" if body["status"] == "incomplete" else "response.completed",
                 "response": body})


# ---- the stored responses ------------------------------------------------------------------
def get_response(store: ResponseStore, response_id: str) -> dict:
    entry = store.get(response_id)
    if entry is None:
        raise not_found(response_id)
    return entry.response


def delete_response(store: ResponseStore, response_id: str) -> dict:
    if not store.delete(response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def cancel_response(store: ResponseStore, response_id: str) -> dict:
    """Only a background response can be cancelled, and this server runs none."""
    get_response(store, response_id)
    raise bad_request("only background responses can be cancelled, and this server does not run them: this "
                      "response has finished", param="response_id")
