"""POST /v1/chat/completions: messages -> the model's chat template -> one engine request
(n sequences) -> a chat.completion body or a chat.completion.chunk SSE stream."""
from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.async_engine import EngineStepError
from .errors import bad_request
from .protocol import ChatCompletionRequest
from .reasoning import make_splitter, split_reasoning
from .serving import SSE_DONE, Serving, SSEResponse, lp_value, pick, sse, usage


def _chat_logprobs(s: Serving, token_ids, lps, k) -> list:
    """OpenAI's logprobs.content: per token its text, logprob, bytes and the top-k sorted."""
    out = []
    for tid, d in zip(token_ids, lps or []):
        text = s.tok_str(tid)
        top = sorted(d.items(), key=lambda kv: -kv[1])[:k] if k else []
        out.append({"token": text, "logprob": lp_value(d.get(tid, -9999.0)), "bytes": list(text.encode()),
                    "top_logprobs": [{"token": s.tok_str(t), "logprob": lp_value(v),
                                      "bytes": list(s.tok_str(t).encode())} for t, v in top]})
    return out


async def create_chat_completion(s: Serving, req: ChatCompletionRequest, raw: Request) -> Response:
    s.check_model(req.model)
    if req.tools:
        raise bad_request("tools are not supported", param="tools")
    if req.response_format is not None and req.response_format.type != "text":
        raise bad_request("only response_format type 'text' is supported", param="response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    k = pick(req.top_logprobs, 0) if req.logprobs else None
    mt_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = pick(req.max_completion_tokens, req.max_tokens)
    params = s.sampling_params(req, max_tokens, k, mt_field, "top_logprobs")
    ids = s.chat_prompt(req.messages, pick(req.add_generation_prompt, True), req.chat_template_kwargs)
    # a reasoning parser reads where the rendered prompt left off (an open <think> block?)
    prompt_text = s.tokenizer.decode(ids) if s.reasoning_parser else ""
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    stream = await s.submit(rid, ids, params, "messages", mt_field)
    created = int(time.time())
    if req.stream:
        opts = req.stream_options
        splitters = [make_splitter(s.reasoning_parser, prompt_text) for _ in range(params.n)]
        return SSEResponse(_chat_sse(s, rid, created, stream, params.n, len(ids), k,
                                      bool(opts and opts.include_usage),
                                      bool(opts and opts.continuous_usage_stats), splitters),
                           on_close=lambda: s.aengine.abort(rid))
    result = await s.until_done_or_gone(raw, s.collect([stream], params.n), [rid])
    if result is None:
        return Response(status_code=499)
    choices = []
    for i, c in enumerate(result):
        message = {"role": "assistant", "content": "".join(c["text"])}
        if s.reasoning_parser:
            message["reasoning_content"], message["content"] = split_reasoning(
                make_splitter(s.reasoning_parser, prompt_text), message["content"])
        choices.append({"index": i, "message": message,
                        "logprobs": {"content": _chat_logprobs(s, c["ids"], c["lps"], k)} if k is not None
                        else None, "finish_reason": c["reason"], "stop_reason": c["stop"]})
    ntok = sum(len(c["ids"]) for c in result)
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": s.model_name,
                         "choices": choices, "usage": usage(len(ids), ntok)})


def _delta(ev, splitter) -> dict:
    """A chunk's delta: the new text as content, or through the reasoning ``splitter`` as
    reasoning_content and / or content (what it held back comes out with the last chunk)."""
    if splitter is None:
        return {"content": ev.text} if ev.text or ev.finish_reason is None else {}
    reasoning, content = splitter.feed(ev.text)
    if ev.finish_reason is not None:
        r2, c2 = splitter.finish()
        reasoning, content = reasoning + r2, content + c2
    return {**({"reasoning_content": reasoning} if reasoning else {}), **({"content": content} if content else {})}


async def _chat_sse(s: Serving, rid, created, stream, n, prompt_len, k, include_usage, continuous, splitters):
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": s.model_name}
    ntok = 0
    try:
        for i in range(n):
            yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        async for ev in stream:
            ntok += len(ev.new_token_ids)
            # skip empty deltas (text held back for stop strings, partial UTF-8 or a possible
            # reasoning tag); a model without a tokenizer streams one empty chunk per token so
            # clients see progress
            delta = _delta(ev, splitters[ev.index])
            if not any(delta.values()) and ev.finish_reason is None and k is None and s.tokenizer is not None:
                continue
            choice = {"index": ev.index, "delta": delta,
                      "logprobs": {"content": _chat_logprobs(s, ev.new_token_ids, ev.logprobs, k)}
                      if k is not None else None, "finish_reason": ev.finish_reason}
            if ev.finish_reason is not None:
                choice["stop_reason"] = ev.stop_reason
            chunk = {**head, "choices": [choice]}
            if continuous and include_usage:
                chunk["usage"] = usage(prompt_len, ntok)
            yield sse(chunk)
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(prompt_len, ntok)})
    except EngineStepError as e:
        yield s.stream_error(e)
    yield SSE_DONE
