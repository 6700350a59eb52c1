"""The OpenAI endpoints' logic: request -> prompt ids + SamplingParams -> AsyncEngine
stream(s) -> a JSON response or an SSE stream. Knows the engine only through AsyncEngine
and a tokenizer copy of its own (the engine thread keeps the original).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.async_engine import AsyncEngine, EngineNotReadyError, EngineStepError, QueueFullError
from ..sampling_params import SamplingParams
from .errors import APIError, bad_request
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

MAX_N = 128
MAX_STOP = 32
_FIELDS = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "max_tokens", "min_tokens", "stop", "stop_token_ids", "logprobs"}


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _lp(x) -> float:
    x = float(x)
    return x if x > -9999.0 else -9999.0  # JSON has no -inf


def _pick(v, default):
    return default if v is None else v


class _SSEResponse(StreamingResponse):
    """A stream that runs ``on_close`` however it ends (done, error, client gone, never started)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except BaseException:  # noqa: BLE001 - cleanup must not mask the real exit
                    pass
            self._on_close()


class Serving:
    def __init__(self, aengine: AsyncEngine, model_name: str, aliases: tuple = ()):
        self.aengine = aengine
        self.model_name = model_name
        self.model_names = {model_name, *aliases}
        self.tokenizer = None          # set by setup() once the engine is loaded
        self.max_model_len = 0
        self.vocab_size = 0
        self.created = int(time.time())
        self._tok_str: dict[int, str] = {}

    def setup(self, engine, tokenizer) -> None:
        """Called from the loading thread, before the engine reports ready."""
        self.tokenizer = tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size

    # ---- shared pieces ---------------------------------------------------------------
    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "blitzllm"}
        if self.aengine.ready:
            card.update(max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        return card

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise bad_request(f"this model has no tokenizer: {what}")
        return self.tokenizer

    def tok_str(self, tid: int) -> str:
        s = self._tok_str.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid]) if self.tokenizer is not None else f"<{tid}>"
            self._tok_str[tid] = s
        return s

    def sampling_params(self, req, max_tokens, logprobs, max_tokens_field="max_tokens",
                        logprobs_field="logprobs") -> SamplingParams:
        if req.n is not None and req.n > MAX_N:
            raise bad_request(f"n must be in [1, {MAX_N}], got {req.n}", param="n")
        if isinstance(req.stop, list) and len(req.stop) > MAX_STOP:
            raise bad_request(f"stop takes at most {MAX_STOP} strings, got {len(req.stop)}", param="stop")
        if req.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")
        try:
            return SamplingParams(
                n=_pick(req.n, 1), temperature=_pick(req.temperature, 1.0), top_p=_pick(req.top_p, 1.0),
                top_k=_pick(req.top_k, 0), min_p=_pick(req.min_p, 0.0), seed=req.seed,
                presence_penalty=_pick(req.presence_penalty, 0.0),
                frequency_penalty=_pick(req.frequency_penalty, 0.0),
                repetition_penalty=_pick(req.repetition_penalty, 1.0), max_tokens=max_tokens,
                min_tokens=_pick(req.min_tokens, 0), stop=req.stop, stop_token_ids=req.stop_token_ids,
                ignore_eos=bool(req.ignore_eos), logprobs=logprobs,
                skip_special_tokens=_pick(req.skip_special_tokens, True),
                include_stop_str_in_output=bool(req.include_stop_str_in_output))
        except ValueError as e:
            raise self._user_error(e, "prompt", max_tokens_field, logprobs_field) from None

    @staticmethod
    def _user_error(e: ValueError, prompt_field: str, max_tokens_field: str = "max_tokens",
                    logprobs_field: str = "logprobs") -> APIError:
        msg = str(e)
        first = msg.split(" ", 1)[0]
        rename = {"max_tokens": max_tokens_field, "logprobs": logprobs_field}
        if first in _FIELDS:
            if first in rename and rename[first] != first:
                msg = rename[first] + msg[len(first):]
            return bad_request(msg, param=rename.get(first, first))
        if "max_tokens" in msg:  # prompt + max_tokens over the context length
            return bad_request(msg.replace("max_tokens", max_tokens_field), param=max_tokens_field,
                               code="context_length_exceeded")
        if "max_model_len" in msg:
            return bad_request(msg, param=prompt_field, code="context_length_exceeded")
        return bad_request(msg, param=prompt_field)

    async def submit(self, rid: str, prompt_ids: list, params: SamplingParams, prompt_field: str,
                     max_tokens_field: str = "max_tokens"):
        try:
            return await self.aengine.add_request(rid, prompt_ids, params)
        except ValueError as e:
            raise self._user_error(e, prompt_field, max_tokens_field) from None
        except QueueFullError as e:
            raise APIError(503, f"the server is overloaded: {e}", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except EngineNotReadyError as e:
            raise APIError(503, f"the model is not ready: {e}", code="model_loading",
                           headers={"Retry-After": "5"}) from None

    async def _until_done_or_gone(self, raw: Request, coro, rids: list):
        """Run a non-streaming collection; abort the requests if the client disconnects."""
        task = asyncio.ensure_future(coro)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    return task.result()
                if await raw.is_disconnected():
                    task.cancel()
                    return None
        finally:
            if not task.done():
                task.cancel()
            for rid in rids:
                self.aengine.abort(rid)

    def _stream_error(self, e: Exception) -> bytes:
        return sse(APIError(500, str(e), type="server_error").body())

    # ---- chat ------------------------------------------------------------------------
    def chat_prompt(self, messages, add_generation_prompt: bool = True) -> list:
        tok = self._need_tokenizer("chat needs a chat template; use /v1/completions with token ids")
        if not getattr(tok, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", param="messages")
        conv = []
        for i, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.type != "text" or part.text is None:
                        raise bad_request(f"messages.{i}.content: only text parts are supported, got "
                                          f"type {part.type!r}", param=f"messages.{i}.content")
                    texts.append(part.text)
                content = "\n".join(texts)
            conv.append({"role": m.role, "content": content or ""})
        try:
            ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja errors from the template (e.g. role order): the input's fault
            raise bad_request(f"the chat template rejected the messages: {e}", param="messages") from None
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def _chat_logprobs(self, token_ids, lps, k) -> list:
        out = []
        for tid, d in zip(token_ids, lps or []):
            s = self.tok_str(tid)
            top = sorted(d.items(), key=lambda kv: -kv[1])[:k] if k else []
            out.append({"token": s, "logprob": _lp(d.get(tid, -9999.0)), "bytes": list(s.encode()),
                        "top_logprobs": [{"token": self.tok_str(t), "logprob": _lp(v),
                                          "bytes": list(self.tok_str(t).encode())} for t, v in top]})
        return out

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        if req.tools:
            raise bad_request("tools are not supported", param="tools")
        if req.response_format is not None and req.response_format.type != "text":
            raise bad_request("only response_format type 'text' is supported", param="response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        k = _pick(req.top_logprobs, 0) if req.logprobs else None
        mt_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = _pick(req.max_completion_tokens, req.max_tokens)
        params = self.sampling_params(req, max_tokens, k, mt_field, "top_logprobs")
        ids = self.chat_prompt(req.messages, _pick(req.add_generation_prompt, True))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self.submit(rid, ids, params, "messages", mt_field)
        created = int(time.time())
        if req.stream:
            opts = req.stream_options
            return _SSEResponse(self._chat_sse(rid, created, stream, params.n, len(ids), k,
                                               bool(opts and opts.include_usage),
                                               bool(opts and opts.continuous_usage_stats)),
                                on_close=lambda: self.aengine.abort(rid))
        result = await self._until_done_or_gone(raw, self._collect([stream], params.n), [rid])
        if result is None:
            return Response(status_code=499)
        choices = []
        for i, c in enumerate(result):
            choices.append({"index": i, "message": {"role": "assistant", "content": "".join(c["text"])},
                            "logprobs": {"content": self._chat_logprobs(c["ids"], c["lps"], k)} if k is not None
                            else None, "finish_reason": c["reason"], "stop_reason": c["stop"]})
        ntok = sum(len(c["ids"]) for c in result)
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": _usage(len(ids), ntok)})

    async def _chat_sse(self, rid, created, stream, n, prompt_len, k, include_usage, continuous):
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        ntok = 0
        try:
            for i in range(n):
                yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
            async for ev in stream:
                ntok += len(ev.new_token_ids)
                if not ev.text and ev.finish_reason is None and k is None:
                    continue
                choice = {"index": ev.index, "delta": {"content": ev.text} if ev.text else {},
                          "logprobs": {"content": self._chat_logprobs(ev.new_token_ids, ev.logprobs, k)}
                          if k is not None else None, "finish_reason": ev.finish_reason}
                if ev.finish_reason is not None:
                    choice["stop_reason"] = ev.stop_reason
                chunk = {**head, "choices": [choice]}
                if continuous and include_usage:
                    chunk["usage"] = _usage(prompt_len, ntok)
                yield sse(chunk)
            if include_usage:
                yield sse({**head, "choices": [], "usage": _usage(prompt_len, ntok)})
        except EngineStepError as e:
            yield self._stream_error(e)
        yield SSE_DONE

    # ---- completions -----------------------------------------------------------------
    def _completion_prompts(self, prompt) -> list:
        """[(ids, echo_text)] for str | list[str] | list[int] | list[list[int]]."""
        if isinstance(prompt, str):
            prompts = [prompt]
        elif not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        elif isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        out = []
        for p in prompts:
            if isinstance(p, str):
                tok = self._need_tokenizer("pass the prompt as token ids")
                ids = tok.encode(p, add_special_tokens=True)
                out.append((ids, p))
            else:
                if not p:
                    raise bad_request("prompt must not be empty", param="prompt")
                if any(t < 0 or t >= self.vocab_size for t in p):
                    raise bad_request(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
                out.append((list(p), None))
        return out

    def _cmpl_logprobs(self, token_ids, lps, k, offset) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, d in zip(token_ids, lps or []):
            s = self.tok_str(tid)
            tokens.append(s)
            token_lps.append(_lp(d.get(tid, -9999.0)))
            top = sorted(d.items(), key=lambda kv: -kv[1])[:k] if k else [(tid, d.get(tid, -9999.0))]
            tops.append({self.tok_str(t): _lp(v) for t, v in top})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _echo_text(self, ids, text) -> str:
        if text is not None:
            return text
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != _pick(req.n, 1):
            raise bad_request("best_of is not supported (it must be null or equal n)", param="best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo with logprobs (prompt logprobs) is not supported", param="echo")
        params = self.sampling_params(req, _pick(req.max_tokens, 16), req.logprobs)
        prompts = self._completion_prompts(req.prompt)
        base = f"cmpl-{uuid.uuid4().hex}"
        rids = [f"{base}-{j}" for j in range(len(prompts))]
        streams = []
        try:
            for rid, (ids, _) in zip(rids, prompts):
                streams.append(await self.submit(rid, ids, params, "prompt"))
        except BaseException:
            for rid in rids:
                self.aengine.abort(rid)
            raise
        created = int(time.time())
        n, k = params.n, req.logprobs
        prompt_tokens = sum(len(ids) for ids, _ in prompts)
        echoes = [self._echo_text(ids, text) if req.echo else "" for ids, text in prompts]
        if req.stream:
            opts = req.stream_options

            def close():
                for rid in rids:
                    self.aengine.abort(rid)
            return _SSEResponse(self._cmpl_sse(base, created, streams, n, k, echoes, prompt_tokens,
                                               bool(opts and opts.include_usage),
                                               bool(opts and opts.continuous_usage_stats)), on_close=close)
        result = await self._until_done_or_gone(raw, self._collect(streams, n), rids)
        if result is None:
            return Response(status_code=499)
        choices = []
        for i, c in enumerate(result):
            echo = echoes[i // n]
            choices.append({"index": i, "text": echo + "".join(c["text"]),
                            "logprobs": self._cmpl_logprobs(c["ids"], c["lps"], k, len(echo)) if k is not None
                            else None, "finish_reason": c["reason"], "stop_reason": c["stop"]})
        ntok = sum(len(c["ids"]) for c in result)
        return JSONResponse({"id": base, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": _usage(prompt_tokens, ntok)})

    async def _cmpl_sse(self, base, created, streams, n, k, echoes, prompt_tokens, include_usage, continuous):
        head = {"id": base, "object": "text_completion", "created": created, "model": self.model_name}
        ntok = 0
        offsets = {}
        try:
            for j, echo in enumerate(echoes):
                for i in range(n):
                    offsets[j * n + i] = len(echo)
                    if echo:
                        yield sse({**head, "choices": [{"index": j * n + i, "text": echo, "logprobs": None,
                                                        "finish_reason": None}]})
            async for j, ev in _merge(streams):
                ntok += len(ev.new_token_ids)
                if not ev.text and ev.finish_reason is None and k is None:
                    continue
                idx = j * n + ev.index
                lp = None
                if k is not None:
                    lp = self._cmpl_logprobs(ev.new_token_ids, ev.logprobs, k, offsets[idx])
                offsets[idx] += len(ev.text)
                choice = {"index": idx, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish_reason}
                if ev.finish_reason is not None:
                    choice["stop_reason"] = ev.stop_reason
                chunk = {**head, "choices": [choice]}
                if continuous and include_usage:
                    chunk["usage"] = _usage(prompt_tokens, ntok)
                yield sse(chunk)
            if include_usage:
                yield sse({**head, "choices": [], "usage": _usage(prompt_tokens, ntok)})
        except EngineStepError as e:
            yield self._stream_error(e)
        yield SSE_DONE

    @staticmethod
    async def _collect(streams, n) -> list:
        out = [{"text": [], "ids": [], "lps": [], "reason": None, "stop": None} for _ in range(len(streams) * n)]
        async for j, ev in _merge(streams):
            c = out[j * n + ev.index]
            c["text"].append(ev.text)
            c["ids"].extend(ev.new_token_ids)
            if ev.logprobs is not None:
                c["lps"].extend(ev.logprobs)
            if ev.finish_reason is not None:
                c["reason"], c["stop"] = ev.finish_reason, ev.stop_reason
        return out

    # ---- tokenizer endpoints -----------------------------------------------------------
    def tokenize(self, req: TokenizeRequest) -> dict:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'", param="prompt")
        if req.messages is not None:
            ids = self.chat_prompt(req.messages, _pick(req.add_generation_prompt, True))
        else:
            tok = self._need_tokenizer("nothing to tokenize with")
            ids = tok.encode(req.prompt, add_special_tokens=_pick(req.add_special_tokens, True))
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": list(ids)}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        self.check_model(req.model)
        tok = self._need_tokenizer("nothing to detokenize with")
        if any(t < 0 or t >= self.vocab_size for t in req.tokens):
            raise bad_request(f"tokens must be in [0, {self.vocab_size})", param="tokens")
        return {"prompt": tok.decode(req.tokens)}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _merge(streams):
    """(stream index, event) from several request streams, as they arrive."""
    if len(streams) == 1:
        async for ev in streams[0]:
            yield 0, ev
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(j, s):
        try:
            async for ev in s:
                q.put_nowait((j, ev))
        except BaseException as e:  # noqa: BLE001 - re-raised by the consumer
            q.put_nowait((j, e))
        finally:
            q.put_nowait((j, None))

    tasks = [asyncio.ensure_future(pump(j, s)) for j, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            j, item = await q.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield j, item
    finally:
        for t in tasks:
            t.cancel()
