"""The router's routes beyond chat and text completions, as ``blitz serve`` has them: OpenAI's
Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel),
Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), POST /v1/embeddings, /classify,
/v1/score and /v1/rerank (with vLLM's aliases), /tokenize, /detokenize and GET /version. Each request goes whole to one backend of ``pool``: a
replica, or in disaggregated mode a decode backend (the servers take ``kv_transfer_params`` on chat
and text completions only, so these have no prefill hand-off; a consumer runs them itself: an
embedding is one prefill with nothing to decode, and no KV to hand over). A request that
names a stored response goes to the backend holding it (``sticky.py``).
"""
from __future__ import annotations

from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Gauge

from .backends import Backend, Pool, prefix_keys
from .bodies import parse_body, prompt_text, read_body
from .proxy import Proxy, RouterError, anthropic_error, error, forward_headers
from .sticky import ResponseOwners, response_id


def _target(request: Request) -> str:
    """The path to ask the backend, with the client's query (Anthropic's SDK may add ``?beta=true``)."""
    q = request.url.query
    return request.url.path + (f"?{q}" if q else "")


def install_endpoints(app: FastAPI, pool: Pool, state: dict, cfg, reg: CollectorRegistry) -> None:
    """``state["proxy"]`` is the running Proxy; ``cfg`` the RouterConfig (its body limit, and
    ``prefix_aware`` for conversations without a stored response)."""
    owners = ResponseOwners()
    pinned = Counter("blitz_router_responses_pinned", "requests sent to the backend that holds the stored "
                     "response they name", registry=reg)
    Gauge("blitz_router_response_ids", "stored response ids whose backend the router remembers",
          registry=reg).set_function(lambda: len(owners))

    def remember(b: Backend, obj: dict) -> bool:
        rid = response_id(obj)
        if rid is not None:
            owners.remember(rid, b)
        return rid is not None

    async def read(request: Request):
        """(raw body, its JSON object), or (an error response, None)."""
        raw = await read_body(request, cfg.max_request_bytes)
        if isinstance(raw, Response):
            return raw, None
        body = parse_body(raw)
        return (body, None) if isinstance(body, Response) else (raw, body)

    def keys_of(body: dict) -> Optional[list]:
        return prefix_keys(prompt_text(body)) if cfg.prefix_aware else None

    async def whole(request: Request, generates: bool, style: str = "openai") -> Response:
        """A POST relayed to the least busy backend (or, when it ``generates`` and the router is
        prefix-aware, the one that saw the conversation's prefix); only generation streams."""
        raw, body = await read(request)
        if body is None:
            return raw
        proxy: Proxy = state["proxy"]
        return await proxy.forward(pool, _target(request), raw, forward_headers(request),
                                   generates and bool(body.get("stream")), request,
                                   keys=keys_of(body) if generates else None, style=style)

    async def sticky(request: Request, rid: str, param: str, content: Optional[bytes], stream: bool) -> Response:
        """A request naming the stored response ``rid``, sent to the backend that made it. While that
        backend is down: a 503 naming it (another server would answer that no such response exists,
        which is not so: it is in that backend's memory, and may be once it is back). An id the router
        does not know (made before the router started, or forgotten past RESPONSE_OWNERS) is asked
        of each healthy backend in turn until one answers other than 404."""
        proxy: Proxy = state["proxy"]
        headers, path = forward_headers(request), _target(request)
        owner = owners.owner(rid)
        if owner is not None:
            if not owner.up:
                return error(503, f"the stored response '{rid}' is held by the backend {owner.url}, which is "
                                  "down; retry when it is back", code="backend_down", param=param)
            pinned.inc()
            return await proxy.forward(pool, path, content, headers, stream, request, method=request.method,
                                       pin=owner, seen=remember, style="responses")
        tried, answer = [], None
        while (b := pool.pick(exclude=tried)) is not None:
            tried.append(b)
            answer = await proxy.forward(pool, path, content, headers, stream, request, method=request.method,
                                         pin=b, seen=remember, style="responses")
            if isinstance(answer, RouterError) and not b.up:
                continue   # (its connection failed: the response may be on another)
            if answer.status_code != 404:
                if answer.status_code < 400:   # (found it: later requests go straight there)
                    owners.remember(rid, b)
                break
        return answer if answer is not None else error(503, f"no {pool.kind} backend is up; retry shortly",
                                                       code="no_backend")

    @app.post("/v1/responses")
    async def responses(request: Request):
        raw, body = await read(request)
        if body is None:
            return raw
        prev = body.get("previous_response_id")
        if isinstance(prev, str) and prev:
            return await sticky(request, prev, "previous_response_id", raw, bool(body.get("stream")))
        proxy: Proxy = state["proxy"]
        return await proxy.forward(pool, _target(request), raw, forward_headers(request), bool(body.get("stream")),
                                   request, keys=keys_of(body), style="responses", seen=remember)

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str, request: Request):
        # (a backend may stream a stored response back with ?stream=true; blitz serve answers JSON)
        return await sticky(request, rid, "response_id", None, request.query_params.get("stream") == "true")

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str, request: Request):
        answer = await sticky(request, rid, "response_id", None, False)
        if answer.status_code == 200:
            owners.forget(rid)
        return answer

    @app.post("/v1/responses/{rid}/cancel")
    async def cancel_response(rid: str, request: Request):
        raw = await read_body(request, cfg.max_request_bytes)
        if isinstance(raw, Response):
            return raw
        return await sticky(request, rid, "response_id", raw or None, False)

    @app.post("/v1/messages")
    async def messages(request: Request):
        return anthropic_error(await whole(request, generates=True, style="anthropic"))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return anthropic_error(await whole(request, generates=False))

    @app.post("/v1/embeddings")
    @app.post("/classify")
    @app.post("/v1/score")
    @app.post("/score")
    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def embeddings(request: Request):   # (and classification and the scoring routes)
        return await whole(request, generates=False)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await whole(request, generates=False)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await whole(request, generates=False)

    @app.get("/version")
    async def version(request: Request):
        proxy: Proxy = state["proxy"]
        return await proxy.forward(pool, _target(request), None, forward_headers(request), False, request,
                                   method="GET")
