"""What the OpenAI endpoints share: model names, the server's own tokenizer copy (the engine
thread keeps the original), request fields -> SamplingParams, submitting to the AsyncEngine
with errors mapped to HTTP, disconnect-aware collection, SSE helpers, /tokenize and
/detokenize. ``chat.py`` and ``completions.py`` build on it. Knows the engine only through
AsyncEngine.
"""
from __future__ import annotations

import asyncio
import copy
import functools
import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..engine.async_engine import (AsyncEngine, DuplicateRequestError, EngineNotReadyError, EngineStepError,
                                   EngineStoppedError, QueueFullError)
from ..engine.request import gather, gathered
from ..engine.intake import logprobs_cap, truncated
from ..http_body import until_done_or_gone
from ..kv_transfer import KVLoadError
from ..structured import INSTALL as STRUCTURED_INSTALL
from ..sampling_params import SamplingParams
from .errors import APIError, bad_request
from .protocol import MAX_N, MAX_STOP
from .chat_template import conversation, prompt_end, render, request_template
from .lora_routes import ServedLoRAs

log = logging.getLogger("blitzllm.server")

_FIELDS = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "max_tokens", "min_tokens", "stop", "stop_token_ids", "logprobs", "logit_bias",
           "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "priority", "dimensions", "normalize"}


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def typed_sse(event: dict) -> bytes:
    """An event named by its ``type`` (``event:`` then ``data:``), as the Responses and Messages
    APIs stream them."""
    return (f"event: {event['type']}\ndata: ".encode() + json.dumps(event, separators=(",", ":")).encode()
            + b"\n\n")


def engine_error(e: EngineStepError) -> APIError:
    """An engine failure while a request ran, as its client sees it."""
    if isinstance(e, EngineStoppedError):
        return APIError(503, str(e), code="shutting_down")
    return APIError(500, str(e), type="server_error")


def lp_value(x) -> float:
    x = float(x)
    return x if x > -9999.0 else -9999.0  # JSON has no -inf


def pick(v, default):
    return default if v is None else v


# A request's CPU work (JSON, templating, tokenizing) runs in the prep pool; a text past
# BULK_CHARS is tokenized in the bulk pool instead: one worker at a lowered OS priority, so short
# requests never queue behind it and the engine's threads keep their cores.
BULK_CHARS = 1 << 15
PREP_WORKERS = 2
PREP_NICE, BULK_NICE = 5, 10  # the workers' niceness (the engine's and the event loop's threads keep 0)
_JSON_IDS_SLICE = 32768  # token ids serialized per call (each call holds the GIL a few ms)


def _lower_priority(nice: int) -> None:
    try:  # Linux: a thread id names that thread alone; raising niceness needs no privilege
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


def max_token_chars(tok) -> Optional[int]:
    """The most characters one token of ``tok`` can cover, when that is a sound bound: a BPE model
    whose alphabet covers every byte (a byte-level pre-tokenizer, or byte fallback), so no input
    character is dropped or merged into an unknown token. Then a text of more than
    ``max_model_len * max_token_chars`` characters cannot fit the context (x4 when a normalizer
    may shorten the text first). None when no such bound holds."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 - a tokenizer that cannot describe itself gets no bound
        return None
    model = spec.get("model") or {}
    byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
        return None
    longest = max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=0)
    return max(1, longest) * (1 if spec.get("normalizer") is None else 4)


def json_with_ids(head: dict, key: str, ids: list) -> bytes:
    """``{**head, key: ids}`` as JSON, the ids serialized in slices (a long list never holds the
    GIL in one call)."""
    parts = [",".join(map(str, ids[i:i + _JSON_IDS_SLICE])) for i in range(0, len(ids), _JSON_IDS_SLICE)]
    return (json.dumps(head, separators=(",", ":"))[:-1] + f',"{key}":[' + ",".join(parts) + "]}").encode()


def request_id(raw: Request) -> str:
    """The request's id: its X-Request-Id (echoed on the response by ``api.RequestIdMiddleware``)
    or the one the middleware generated; the engine request ids and response ids carry it."""
    return getattr(raw.state, "request_id", None) or uuid.uuid4().hex


class SSEResponse(StreamingResponse):
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
    def __init__(self, aengine: AsyncEngine, model_name: str, aliases: tuple = (),
                 reasoning_parser: Optional[str] = None, tool_parser: Optional[str] = None,
                 return_tokens_as_token_ids: bool = False, lora_modules: tuple = (),
                 trust_request_chat_template: bool = False, listed: tuple = (), prompt_tokens_details: bool = False,
                 media_domains: tuple = ()):
        self.aengine = aengine
        self.media_domains = media_domains   # the hosts image URLs may name (server/vision.py; all when empty)
        self.prompt_tokens_details = prompt_tokens_details
        self.trust_request_chat_template = trust_request_chat_template
        self.loras = ServedLoRAs(lora_modules)   # the adapters a request's model may name (lora_routes.py)
        self.return_tokens_as_token_ids = return_tokens_as_token_ids  # (a request's own field overrides it)
        self.reasoning_parser = reasoning_parser  # (server/reasoning.py)
        self.tool_parser = tool_parser            # (server/tools.py)
        self.model_name = model_name
        self.model_names = {model_name, *aliases}
        self.listed = (model_name, *listed)   # the names /v1/models shows (--served-model-name's)
        self.tokenizer = None          # set by setup() once the engine is loaded
        self.defaults: dict = {}       # the engine's sampling_defaults (generation config)
        self.max_model_len = 0
        self.vocab_size, self.max_logprobs = 0, 20   # (the engine's max_logprobs, resolved)
        self.classifier, self.labels = False, ()   # a sequence classifier's (server/classify.py, score.py)
        self.created = int(time.time())
        self._tok_str: dict[int, str] = {}
        self.max_prompt_chars: Optional[int] = None  # a prompt longer than this cannot fit (see max_token_chars)
        # a request's CPU work runs in these pools, never on the event loop; each worker thread
        # has its own tokenizer copy (HF tokenizers are not safe to share between threads)
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(PREP_WORKERS, "blitz-prep", initializer=self._init_worker)
        self._bulk = ThreadPoolExecutor(1, "blitz-bulk", initializer=self._init_worker, initargs=(True,))

    def setup(self, engine, tokenizer) -> None:
        """Called from the loading thread, before the engine reports ready."""
        self.tokenizer = tokenizer
        self.max_model_len = engine.max_model_len
        self.defaults = dict(engine.sampling_defaults)
        if self.defaults:  # (vLLM says so too: a request's unset fields no longer get OpenAI's defaults)
            log.info("sampling defaults from the generation config, for fields a request leaves unset: %s",
                     self.defaults)
        self.vocab_size = engine.model_config.vocab_size
        self.max_logprobs = logprobs_cap(getattr(getattr(engine, "args", None), "max_logprobs", 20), self.vocab_size)
        self.classifier, self.labels = engine.model_config.is_classifier, engine.model_config.labels
        self.loras.setup(engine, self.model_names)
        if tokenizer is not None:
            per_token = max_token_chars(tokenizer)
            self.max_prompt_chars = None if per_token is None else per_token * engine.max_model_len
            for pool, n in ((self._pool, PREP_WORKERS), (self._bulk, 1)):  # start the workers (tokenizer copies) now
                barrier = threading.Barrier(n)
                for f in [pool.submit(barrier.wait, 60) for _ in range(n)]:
                    f.result()

    def _init_worker(self, bulk: bool = False) -> None:
        _lower_priority(BULK_NICE if bulk else PREP_NICE)
        if self.tokenizer is not None:
            self._local.tokenizer = copy.deepcopy(self.tokenizer)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._bulk.shutdown(wait=False, cancel_futures=True)

    async def cpu(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` in a prep worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def tokens(self, text: str, add_special_tokens: bool, param: Optional[str] = None) -> list:
        """``encode`` in a worker thread: the bulk pool for a long text."""
        pool = self._bulk if len(text) > BULK_CHARS else self._pool
        return await asyncio.get_running_loop().run_in_executor(pool, self.encode, text, add_special_tokens, param)

    def worker_tokenizer(self, what: str):
        """This worker thread's tokenizer copy (400 ``what`` when the model has none)."""
        self.need_tokenizer(what)
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:  # (a worker started before the model loaded)
            tok = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return tok

    def encode(self, text: str, add_special_tokens: bool, param: Optional[str] = None) -> list:
        """``tokenizer.encode(text)`` in a worker thread, with the GIL released while the tokenizer
        works (its Rust batch call); with ``param``, a prompt too long to fit is a 400 naming it,
        found without building its list of ids."""
        tok = self.worker_tokenizer("nothing to tokenize with")
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None:  # a Python tokenizer
            enc = tok.encode(text, add_special_tokens=add_special_tokens)
        else:  # (len(enc) counts the tokens without building their list)
            enc = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if param is not None:
            self.check_prompt_len(len(enc), param)
        return list(enc if backend is None else enc.ids)

    def check_prompt_chars(self, text: str, param: str) -> None:
        """A 400 (context_length_exceeded) for a text too long to fit, before tokenizing it."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise bad_request(f"the prompt has {len(text)} characters, more than any prompt of max_model_len="
                              f"{self.max_model_len} tokens can hold ({self.max_prompt_chars})", param=param,
                              code="context_length_exceeded")

    def check_prompt_len(self, n: int, param: str) -> None:
        """A 400 (context_length_exceeded) for a prompt of ``n`` tokens that leaves no room to generate."""
        if n >= self.max_model_len:
            raise bad_request(f"the prompt has {n} tokens, which leaves no room to generate within max_model_len="
                              f"{self.max_model_len}", param=param, code="context_length_exceeded")

    # ---- shared pieces ---------------------------------------------------------------
    def check_model(self, name: Optional[str]):
        """The LoRARequest of the adapter ``name`` names, None for the base model, else a 404."""
        if name is None or name in self.model_names:
            return None
        lora = self.loras.get(name)
        if lora is None:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        return lora

    def answer_model(self, lora) -> str:
        """The ``model`` an answer names: the adapter's name under one (vLLM's), else the served one."""
        return self.model_name if lora is None else lora.lora_name

    def cached(self, per_prompt) -> Optional[int]:
        """A usage's cached prompt tokens (None without --enable-prompt-tokens-details)."""
        return sum(per_prompt) if self.prompt_tokens_details else None

    def models(self) -> dict:
        return {"object": "list", "data": [*(self.model_card(n) for n in self.listed),
                                           *self.loras.cards(self.model_name, self.created)]}

    def model_card(self, name: Optional[str] = None) -> dict:
        card = {"id": name or self.model_name, "object": "model", "created": self.created, "owned_by": "blitzllm"}
        if self.aengine.ready:
            card.update(max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        return card

    def need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise bad_request(f"this model has no tokenizer: {what}")

    def tok_str(self, tid: int) -> str:
        s = self._tok_str.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid]) if self.tokenizer is not None else f"<{tid}>"
            self._tok_str[tid] = s
        return s

    @staticmethod
    def structured_request(req) -> tuple:
        """(``SamplingParams.structured_output`` spec, the request field it came from) of vLLM's
        ``structured_outputs`` / ``guided_*`` fields, (None, None) without them."""
        so = req.structured_outputs or {}
        if not isinstance(so, dict):
            raise bad_request("structured_outputs must be an object", param="structured_outputs")
        given = [(f"structured_outputs.{k}", k, v) for k, v in so.items() if v not in (None, False)]
        given += [(f"guided_{k}", k, getattr(req, f"guided_{k}")) for k in ("json", "regex", "choice", "grammar")
                  if getattr(req, f"guided_{k}") is not None]
        if not given:
            return None, None
        if len(given) > 1:
            raise bad_request(f"give one structured output constraint, got {', '.join(f for f, _, _ in given)}",
                              param=given[1][0])
        field, kind, value = given[0]
        specs = {"json": lambda v: {"type": "json_schema", "schema": v}, "json_object": lambda v: {"type": "json_object"},
                 "regex": lambda v: {"type": "regex", "pattern": v}, "choice": lambda v: {"type": "choice", "choices": v},
                 "grammar": lambda v: {"type": "grammar", "grammar": v},
                 "structural_tag": lambda v: {"type": "structural_tag", "structural_tag": v}}
        if kind not in specs:
            raise bad_request(f"structured_outputs takes one of {', '.join(specs)}, got {kind!r}", param=field)
        return specs[kind](value), field

    def sampling_params(self, req, max_tokens, logprobs, max_tokens_field="max_tokens",
                        logprobs_field="logprobs", structured=(None, None),
                        prompt_logprobs: Optional[int] = None) -> SamplingParams:
        """``req``: a ``SamplingFields`` body (with ``n`` where it has one); ``structured``:
        ``structured_request(req)``, read once by the endpoint."""
        n = getattr(req, "n", None)
        if n is not None and n > MAX_N:
            raise bad_request(f"n must be in [1, {MAX_N}], got {n}", param="n")
        if isinstance(req.stop, list) and len(req.stop) > MAX_STOP:
            raise bad_request(f"stop takes at most {MAX_STOP} strings, got {len(req.stop)}", param="stop")
        bias = None
        if req.logit_bias:
            # (a longer key is no token id, and int() refuses past 4300 digits)
            if not all(k.isdigit() and k.isascii() and len(k.lstrip("0")) <= 18 for k in req.logit_bias):
                raise bad_request("logit_bias keys must be token ids (decimal integers >= 0)", param="logit_bias")
            bias = {int(k): v for k, v in req.logit_bias.items()}
        structured, field, d = *structured, self.defaults
        self.check_logprobs(logprobs, logprobs_field)
        self.check_logprobs(prompt_logprobs, "prompt_logprobs")
        try:
            return SamplingParams(
                n=pick(n, 1), temperature=pick(req.temperature, d.get("temperature", 1.0)),
                top_p=pick(req.top_p, d.get("top_p", 1.0)), top_k=pick(req.top_k, d.get("top_k", 0)),
                min_p=pick(req.min_p, d.get("min_p", 0.0)), seed=req.seed,
                presence_penalty=pick(req.presence_penalty, 0.0), frequency_penalty=pick(req.frequency_penalty, 0.0),
                repetition_penalty=pick(req.repetition_penalty, d.get("repetition_penalty", 1.0)),
                max_tokens=max_tokens,
                min_tokens=pick(req.min_tokens, 0), stop=req.stop, stop_token_ids=req.stop_token_ids,
                ignore_eos=bool(req.ignore_eos), logprobs=logprobs,
                skip_special_tokens=pick(req.skip_special_tokens, True),
                include_stop_str_in_output=bool(req.include_stop_str_in_output), structured_output=structured,
                logit_bias=bias, prompt_logprobs=prompt_logprobs, allowed_token_ids=req.allowed_token_ids,
                bad_words=req.bad_words, truncate_prompt_tokens=self.truncation(req))
        except ValueError as e:
            raise self._user_error(e, "prompt", max_tokens_field, logprobs_field, field) from None

    def check_logprobs(self, k: Optional[int], field: str) -> None:
        if k is not None and k > self.max_logprobs:
            raise bad_request(f"{field} must be at most {self.max_logprobs} (the server's --max-logprobs), got {k}",
                              param=field)

    def truncation(self, req) -> Optional[int]:
        """The body's truncate_prompt_tokens (chat and completions have one), checked against
        max_model_len; None when not asked."""
        k = getattr(req, "truncate_prompt_tokens", None)
        if k is not None and k > self.max_model_len:
            raise bad_request(f"truncate_prompt_tokens ({k}) must be at most max_model_len={self.max_model_len}",
                              param="truncate_prompt_tokens")
        return k

    def truncated(self, ids: list, params: SamplingParams, param: str) -> list:
        """The prompt ids the engine will see (``truncate_prompt_tokens``), refused when they leave
        no room to generate."""
        ids = truncated(ids, params.truncate_prompt_tokens, self.max_model_len)
        self.check_prompt_len(len(ids), param)
        return ids

    @staticmethod
    def _user_error(e: ValueError, prompt_field: str, max_tokens_field: str = "max_tokens",
                    logprobs_field: str = "logprobs", structured_field: Optional[str] = None) -> APIError:
        msg = str(e)
        first = msg.split(" ", 1)[0]
        rename = {"max_tokens": max_tokens_field, "logprobs": logprobs_field}
        if first in _FIELDS:
            param = rename.get(first, first)
            return bad_request(param + msg[len(first):], param=param)
        if first == "structured_output" or msg == STRUCTURED_INSTALL:
            return bad_request(msg, param=structured_field or "structured_outputs")
        if "max_tokens" in msg:  # prompt + max_tokens over the context length
            return bad_request(msg.replace("max_tokens", max_tokens_field), param=max_tokens_field,
                               code="context_length_exceeded")
        if "max_model_len" in msg:
            return bad_request(msg, param=prompt_field, code="context_length_exceeded")
        return bad_request(msg, param=prompt_field)

    async def submit(self, rid: str, prompt_ids: list, params: SamplingParams, prompt_field: str,
                     max_tokens_field: str = "max_tokens", structured_field: Optional[str] = None,
                     kv_transfer_params: Optional[dict] = None, priority: Optional[int] = 0, lora_request=None,
                     images=None, cache_salt: Optional[str] = None, prompt_embeds=None):
        try:
            stream = await self.aengine.add_request(rid, prompt_ids, params, kv_transfer_params, priority or 0,
                                                    lora_request, images, cache_salt, prompt_embeds)
            log.debug("request %s: %d prompt tokens, max_tokens %s", rid,
                      len(prompt_ids) if prompt_embeds is None else len(prompt_embeds),
                      getattr(params, "max_tokens", 0))   # (0: an embedding)
            return stream
        except DuplicateRequestError as e:
            raise bad_request(f"{e}: an X-Request-Id names one request in flight at a time",
                              code="duplicate_request_id") from None
        except ValueError as e:
            raise self._user_error(e, prompt_field, max_tokens_field, structured_field=structured_field) from None
        except KVLoadError as e:  # (kv_load_failure_policy 'fail')
            raise APIError(503, f"could not load the prompt's KV from the producer: {e}", code="kv_load_failed",
                           headers={"Retry-After": "1"}) from None
        except QueueFullError as e:
            raise APIError(503, f"the server is overloaded: {e}", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except EngineNotReadyError as e:
            raise APIError(503, f"the model is not ready: {e}", code="model_loading",
                           headers={"Retry-After": "5"}) from None

    async def until_done_or_gone(self, raw: Request, coro, streams: list):
        """Run a non-streaming collection; abort the requests if the client disconnects."""
        try:
            result = await until_done_or_gone(raw, coro, poll_s=0.5)
            if result is None:
                for st in streams:   # (a producer's request that finished meanwhile: its lease)
                    if st.finished:
                        self.aengine.release_lease(st)
            return result
        except EngineStepError as e:
            raise engine_error(e) from None
        finally:
            self.abort(streams)

    def abort(self, streams: list) -> None:
        for st in streams:   # (by stream: a finished one's id may already name another request)
            self.aengine.abort(st.request_id, st)

    def stream_error(self, e: Exception) -> bytes:
        return sse(engine_error(e).body())

    async def chat_prompt(self, messages, end: Optional[dict] = None, template_kwargs=None, tools=None,
                          check_length: bool = True, require_tools: bool = False,
                          add_special_tokens: bool = False, template: Optional[str] = None,
                          images: bool = False) -> tuple:
        """(token ids, rendered text) of ``messages`` through the model's chat template, with
        ``template_kwargs`` (the request's ``chat_template_kwargs``) and ``tools`` where given, ending as
        ``end`` says (``chat_template.prompt_end``; None: an opened assistant turn), in worker threads. A text past the character bound is refused before it is tokenized;
        ``check_length``: and one of too many tokens after. ``template``: a request's own chat
        template (vLLM's ``chat_template`` field), refused unless --trust-request-chat-template."""
        template = request_template(template, self.trust_request_chat_template)
        text = await self.cpu(self.render_chat, messages, end or prompt_end(True, False), template_kwargs, tools,
                              require_tools, template, images)
        # (by default what apply_chat_template(tokenize=True) does: no special tokens added to the rendered
        # text; vLLM's embeddings may ask for them, add_special_tokens)
        return await self.tokens(text, add_special_tokens, "messages" if check_length else None), text

    def render_chat(self, messages, end: dict, template_kwargs, tools, require_tools: bool = False,
                    template: Optional[str] = None, images: bool = False) -> str:
        """The chat template's text (see ``chat_prompt``), in a worker thread. ``require_tools``
        (tool_choice "auto": the model must see the tools to call them): a 400 when the template
        renders the same text without them."""
        tok = self.worker_tokenizer("chat needs a chat template; use /v1/completions with token ids")
        if template is None and not getattr(tok, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", param="messages")
        text = render(tok, conversation(messages, images), end, template_kwargs, tools, require_tools, template)
        self.check_prompt_chars(text, "messages")
        return text

    @staticmethod
    async def collect(streams, n) -> list:
        """Per choice (prompt * n + index): text pieces, token ids, logprobs, finish, prompt logprobs
        (the first choice of each prompt, where asked for)."""
        out = [gathered() for _ in range(len(streams) * n)]
        async for j, ev in merge(streams):
            gather(out[j * n + ev.index], ev)
        return out


def kv_field(result: list) -> dict:
    """A producer's answer carries its first choice's kv_transfer_params."""
    return {"kv_transfer_params": result[0]["kv"]} if result and result[0].get("kv") else {}


def usage(prompt_tokens: int, completion_tokens: int, cached: Optional[int] = None) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached is not None:   # (Serving.cached: --enable-prompt-tokens-details)
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


async def merge(streams):
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
