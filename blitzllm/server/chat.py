"""POST /v1/chat/completions: messages -> the model's chat template -> one engine request
(n sequences) -> a chat.completion body or a chat.completion.chunk SSE stream. Owns the chat turn
(``prepare_turn``: tools, structured outputs, prompt, sampling params; ``ChatTurn``: reading the
output through the reasoning and tool-call parsers), which /v1/responses builds on too."""
from __future__ import annotations

import time
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.async_engine import EngineStepError
from .beam import beam_answers, beam_params
from .chat_template import prompt_end
from .errors import bad_request
from .protocol import ChatCompletionRequest
from .reasoning import END, THINK_PARSERS, fed, make_splitter, prompt_opens_thinking, split_reasoning
from .tools import FORMATS, Forced, ToolCallSplitter, check_tools, split_tool_calls
from .vision import chat_images, expand_images
from .serving import SSE_DONE, Serving, SSEResponse, kv_field, lp_value, pick, request_id, sse, usage


def token_str(s: Serving, tid: int, as_ids: bool = False) -> str:
    """A logprobs entry's token: its text, or ``token_id:<id>`` (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{tid}" if as_ids else s.tok_str(tid)


def as_token_ids(s: Serving, req) -> bool:
    """The request's return_tokens_as_token_ids, else the server's."""
    return pick(req.return_tokens_as_token_ids, s.return_tokens_as_token_ids)


def chat_logprobs(s: Serving, token_ids, lps, k, as_ids: bool = False) -> list:
    """OpenAI's logprobs.content: per token its text (``as_ids``: ``token_id:<id>``), logprob,
    bytes and the top-k sorted."""
    out = []
    for tid, d in zip(token_ids, lps or []):
        text = token_str(s, tid, as_ids)
        top = sorted(d.items(), key=lambda kv: -kv[1])[:k] if k else []
        out.append({"token": text, "logprob": lp_value(d.get(tid, -9999.0)), "bytes": list(text.encode()),
                    "top_logprobs": [{"token": (t_text := token_str(s, t, as_ids)), "logprob": lp_value(v),
                                      "bytes": list(t_text.encode())} for t, v in top]})
    return out


def prompt_logprobs_body(s: Serving, ids, plp, ranks, k: int, asked: int) -> list:
    """vLLM's ``prompt_logprobs`` of a prompt (``ids``): null for its first token, then per token
    {token id as a string: {logprob, rank, decoded_token}} for the token, then its top ``k`` (ranks
    1..k by position, the token's own entry among them where it is one of them; else its rank in
    the whole vocabulary). ``plp``/``ranks``: the engine's, asked for the top ``asked`` (>= k)."""
    if plp is None:   # (none came: a request that ended before its prefill)
        return None
    out = [None]
    for tid, d, rank in zip(ids[1:], plp[1:], ranks[1:]):
        entry = {str(tid): {"logprob": lp_value(d[tid]), "rank": rank, "decoded_token": s.tok_str(tid)}}
        # (the engine's dict: the token, then the top ``asked``, the token counted once where it is among them)
        top = sorted(((t, v) for t, v in d.items() if t != tid or len(d) == asked), key=lambda kv: -kv[1])
        for r, (t, v) in enumerate(top[:k], 1):
            entry[str(t)] = {"logprob": lp_value(v), "rank": r, "decoded_token": s.tok_str(t)}
        out.append(entry)
    return out


def check_prompt_logprobs(req) -> Optional[int]:
    """What the engine computes for the request's prompt_logprobs: a stream has no place for them
    (a 400, as vLLM's, but for 0, which streams nothing)."""
    if req.prompt_logprobs and req.stream:
        raise bad_request("prompt_logprobs are not available with stream=true", param="prompt_logprobs")
    return None if req.stream else req.prompt_logprobs


class ChatTurn:
    """A conversation rendered for the engine: its prompt, its sampling params (with the
    structured output a ``response_format`` or a forced tool choice asks for) and how its output
    is read (reasoning, tool calls). Chat completions and responses (``responses.py``) both
    build one with ``prepare_turn``."""

    def __init__(self, ids, prompt_text, params, structured_field, tools, tool_mode, one_call, images=()):
        self.ids, self.params, self.structured_field = ids, params, structured_field
        self.images = list(images)   # the image parts' model inputs (server/vision.py); ids count their tokens
        self.prompt_text = prompt_text  # the rendered prompt where a reasoning parser reads it, else ""
        self.tools, self.tool_mode, self.one_call = tools, tool_mode, one_call
        self.forced = tool_mode if isinstance(tool_mode, Forced) else None

    def parser(self, s: Serving) -> "ChoiceParser":
        """One streamed sequence's parser."""
        forced = self.forced
        return ChoiceParser(make_splitter(s.reasoning_parser, self.prompt_text),
                            forced.splitter() if forced else
                            ToolCallSplitter(FORMATS[s.tool_parser], self.tools) if self.tool_mode else None,
                            self.one_call, forced is not None)

    def message(self, s: Serving, text: str, reason):
        """(the assistant message, the finish reason) of a whole output."""
        message = {"role": "assistant", "content": text}
        if s.reasoning_parser:
            message["reasoning_content"], message["content"] = split_reasoning(
                make_splitter(s.reasoning_parser, self.prompt_text), message["content"])
        if self.forced is not None:  # (the answer is the calls' JSON; cut short, it stays text)
            calls = self.forced.calls(message["content"] or "")
            if calls:
                message["content"], message["tool_calls"] = None, calls[:1] if self.one_call else calls
        elif self.tool_mode is not None:
            message["content"], calls = split_tool_calls(message["content"], s.tool_parser, self.tools)
            if calls:
                message["tool_calls"] = calls[:1] if self.one_call else calls
                reason = "tool_calls" if reason == "stop" else reason
        return message, reason


async def prepare_turn(s: Serving, req, messages, *, tools, tool_choice, parallel_tool_calls, structured: tuple,
                       max_tokens, max_tokens_field: str, k, end: dict, template_kwargs,
                       prompt_logprobs: Optional[int] = None, template: Optional[str] = None) -> ChatTurn:
    """``req``: the body's sampling fields (``protocol.SamplingFields``); ``structured``: (the
    answer's structured output or None, the field it came from); ``k``: top logprobs (None: no
    logprobs); ``prompt_logprobs``: the rendered prompt's top-N (None: none); ``template``: the
    request's own chat template (``Serving.chat_prompt``)."""
    tool_mode = check_tools(tools, tool_choice, s.tool_parser)  # None, "auto" or a Forced choice
    forced = tool_mode if isinstance(tool_mode, Forced) else None
    requested = s.structured_request(req)  # (vLLM's structured_outputs / guided_* fields)
    params = s.sampling_params(req, max_tokens, k, max_tokens_field, "top_logprobs", requested,
                               prompt_logprobs=prompt_logprobs)
    structured, field = structured
    if forced is not None:
        if structured is not None:
            raise bad_request(f"{field} and a forced tool_choice do not go together", param=field)
        structured, field = forced.structured_output(), "tool_choice"
    if structured is not None:
        if params.structured_output is not None:
            raise bad_request(f"{field} and structured_outputs / guided_* do not go together", param=field)
        try:
            params = params.clone(structured_output=structured)
        except ValueError as e:
            raise bad_request(str(e), param=field) from None
    else:
        field = requested[1]
    if tool_mode == "auto" and FORMATS[s.tool_parser].special_tokens:
        # the format's markers are special tokens ([TOOL_CALLS]): decoded, as vLLM's Mistral
        # parser asks, or its calls could not be found
        params = params.clone(skip_special_tokens=False)
    cut = params.truncate_prompt_tokens is not None
    images = await chat_images(s, messages)
    ids, prompt_text = await s.chat_prompt(messages, end, template_kwargs, tools if tool_mode is not None else None,
                                           check_length=not cut and not images, require_tools=tool_mode == "auto",
                                           template=template, images=bool(images))
    if images:
        ids = await expand_images(s, ids, prompt_text, images)
        if not cut:
            s.check_prompt_len(len(ids), "messages")
    if cut:  # (the template's end stays: only the conversation's start goes)
        ids = s.truncated(ids, params, "messages")
    # a reasoning parser reads where the rendered prompt left off (an open <think> block?)
    prompt_text = prompt_text if s.reasoning_parser else ""
    if structured is not None and s.reasoning_parser in THINK_PARSERS and prompt_opens_thinking(prompt_text):
        # the answer's grammar (a forced call, a response_format) starts after the thinking
        params = params.clone(structured_output={**structured, "start_after": END})
    return ChatTurn(ids, prompt_text, params, field, tools, tool_mode, parallel_tool_calls is False, images)


async def create_chat_completion(s: Serving, req: ChatCompletionRequest, raw: Request) -> Response:
    lora = s.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    k = pick(req.top_logprobs, 0) if req.logprobs else None
    plp_k, as_ids = check_prompt_logprobs(req), as_token_ids(s, req)
    mt_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    turn = await prepare_turn(s, req, req.messages, tools=req.tools, tool_choice=req.tool_choice,
                              parallel_tool_calls=req.parallel_tool_calls,
                              structured=(structured_output(req.response_format), "response_format"),
                              max_tokens=pick(req.max_completion_tokens, req.max_tokens), max_tokens_field=mt_field,
                              k=k, end=prompt_end(req.add_generation_prompt, req.continue_final_message),
                              template_kwargs=req.chat_template_kwargs, prompt_logprobs=plp_k,
                              template=req.chat_template)
    ids, params = turn.ids, turn.params
    rid = f"chatcmpl-{request_id(raw)}"
    if req.use_beam_search:
        if turn.images:
            raise bad_request("use_beam_search takes text only, no images", param="use_beam_search")
        return await _beam_chat(s, req, raw, rid, turn, mt_field, k, as_ids, lora)
    stream = await s.submit(rid, ids, params, "messages", mt_field, structured_field=turn.structured_field,
                            kv_transfer_params=req.kv_transfer_params, priority=req.priority, lora_request=lora,
                            images=turn.images, cache_salt=req.cache_salt)
    created = int(time.time())
    if req.stream:
        opts = req.stream_options
        parsers = [turn.parser(s) for _ in range(params.n)]
        return SSEResponse(_chat_sse(s, rid, created, stream, params.n, len(ids), k,
                                      bool(opts and opts.include_usage),
                                      bool(opts and opts.continuous_usage_stats), parsers, as_ids,
                                      s.answer_model(lora)),
                           on_close=lambda: s.aengine.abort(rid, stream))
    result = await s.until_done_or_gone(raw, s.collect([stream], params.n), [stream])
    if result is None:
        return Response(status_code=499)
    choices = []
    for i, c in enumerate(result):
        message, reason = turn.message(s, "".join(c["text"]), c["reason"])
        choices.append({"index": i, "message": message,
                        "logprobs": {"content": chat_logprobs(s, c["ids"], c["lps"], k, as_ids)} if k is not None
                        else None, "finish_reason": reason, "stop_reason": c["stop"]})
    ntok = sum(len(c["ids"]) for c in result)
    plp = {}
    if plp_k is not None:   # (the first choice's: the engine scores the prompt once for the n)
        plp = {"prompt_logprobs": prompt_logprobs_body(s, ids, result[0]["plp"], result[0]["ranks"], plp_k, plp_k)}
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": s.answer_model(lora),
                         "choices": choices, "usage": usage(len(ids), ntok, s.cached([result[0]["cached"]])), **plp,
                         **kv_field(result)})


async def _beam_chat(s: Serving, req: ChatCompletionRequest, raw: Request, rid: str, turn: ChatTurn, mt_field: str,
                     k: Optional[int], as_ids: bool, lora) -> Response:
    """use_beam_search: choice i is the i-th best beam, through the reasoning and tool parsers."""
    if turn.params.structured_output is not None:
        raise bad_request(f"{turn.structured_field} does not go with use_beam_search", param=turn.structured_field)
    ids = turn.ids
    bp = beam_params(req, turn.params, s.max_model_len - len(ids))
    beams = await beam_answers(s, raw, rid, [ids], bp, "messages", mt_field, req.priority, lora, req.cache_salt)
    if beams is None:
        return Response(status_code=499)
    choices, ntok = [], 0
    for i, b in enumerate(beams[0]):
        gen = b.tokens[len(ids):]
        ntok += len(gen)
        message, reason = turn.message(s, b.text, b.finish_reason)
        choices.append({"index": i, "message": message, "finish_reason": reason, "stop_reason": None,
                        "logprobs": {"content": chat_logprobs(s, gen, b.logprobs, k, as_ids)} if k is not None else None})
    return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()),
                         "model": s.answer_model(lora), "choices": choices, "usage": usage(len(ids), ntok)})


def structured_output(fmt):
    """``response_format`` as ``SamplingParams.structured_output`` (None for text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.type == "json_schema":
        schema = (fmt.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise bad_request("response_format json_schema needs json_schema.schema (an object)",
                              param="response_format")
        return {"type": "json_schema", "schema": schema}
    if fmt.type == "structural_tag":   # (blitzllm/structured.py checks the parts: a ValueError is a 400 on this field)
        parts = {k: getattr(fmt, k) for k in ("structures", "triggers", "format") if getattr(fmt, k) is not None}
        return {"type": "structural_tag", "structural_tag": parts}
    raise bad_request(f"response_format type must be text, json_object, json_schema or structural_tag, got {fmt.type!r}",
                      param="response_format")


class ChoiceParser:
    """One streamed choice's text through the reasoning splitter, then its content through the
    tool-call splitter; what they hold back comes out with the last chunk. ``called``: parsed
    calls came out (a forced choice's do not make the finish reason "tool_calls")."""

    def __init__(self, reasoning, tools, one_call: bool = False, forced: bool = False):
        self.reasoning, self.tools, self.one_call, self.forced = reasoning, tools, one_call, forced
        self.called = False

    def delta(self, text: str, final: bool) -> dict:
        if self.reasoning is None and self.tools is None:
            return {"content": text} if text or not final else {}
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = fed(self.reasoning, text, final)
        calls = []
        if self.tools is not None:
            content, calls = fed(self.tools, content, final)
            calls = [c for c in calls if not (self.one_call and c["index"] > 0)]
            self.called = self.called or (bool(calls) and not self.forced)
        return {**({"reasoning_content": reasoning} if reasoning else {}), **({"content": content} if content else {}),
                **({"tool_calls": calls} if calls else {})}


async def _chat_sse(s: Serving, rid, created, stream, n, prompt_len, k, include_usage, continuous, parsers, as_ids,
                    model: str):
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    ntok = cached = 0
    try:
        for i in range(n):   # (continuous usage: on every chunk, these too, as vLLM sends it)
            yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}],
                       **({"usage": usage(prompt_len, 0)} if continuous and include_usage else {})})
        async for ev in stream:
            ntok += len(ev.new_token_ids)
            if ev.index == 0 and ev.num_cached_tokens is not None:   # (the prompt's, once for the n)
                cached = ev.num_cached_tokens
            # skip empty deltas (text held back for stop strings, partial UTF-8 or a possible
            # reasoning tag); a model without a tokenizer streams one empty chunk per token so
            # clients see progress
            parser = parsers[ev.index]
            delta = parser.delta(ev.text, ev.finish_reason is not None)
            if not any(delta.values()) and ev.finish_reason is None and k is None and s.tokenizer is not None:
                continue
            reason = "tool_calls" if parser.called and ev.finish_reason == "stop" else ev.finish_reason
            choice = {"index": ev.index, "delta": delta,
                      "logprobs": {"content": chat_logprobs(s, ev.new_token_ids, ev.logprobs, k, as_ids)}
                      if k is not None else None, "finish_reason": reason}
            if ev.finish_reason is not None:
                choice["stop_reason"] = ev.stop_reason
            chunk = {**head, "choices": [choice]}
            if continuous and include_usage:
                chunk["usage"] = usage(prompt_len, ntok, s.cached([cached]))
            yield sse(chunk)
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(prompt_len, ntok, s.cached([cached]))})
    except EngineStepError as e:
        yield s.stream_error(e)
    yield SSE_DONE
