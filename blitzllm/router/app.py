"""The router's FastAPI app: ``/v1/chat/completions`` and ``/v1/completions`` (disaggregated:
prefill on a producer, then decode on a consumer with the producer's ``kv_transfer_params``;
or replicas), ``/v1/models``, ``/health`` (503 while a needed kind of backend is down),
``/metrics``, and the error bodies of unknown paths and wrong methods; the other endpoints of
``blitz serve`` are ``endpoints.py``'s. Backend health is polled in the background, so a backend that returns is used
again within one interval.
"""
from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from .backends import Pool, prefix_keys, probe, watch
from .bodies import parse_body, prompt_text, read_body
from .endpoints import install_endpoints
from .fanout import child_bodies, fan_out_n, merge_answers, merge_streams
from .proxy import TIMED_OUT, Proxy, anthropic_error, error, forward_headers, timed_out

log = logging.getLogger("blitzllm.router")


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple = ()
    decode: tuple = ()
    backends: tuple = ()
    prefix_aware: bool = False
    health_interval_s: float = 1.0
    request_timeout_s: float = 600.0
    max_request_bytes: int = 8 << 20
    host: str = "127.0.0.1"
    port: int = 8080

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)


def build_router_app(cfg: RouterConfig) -> FastAPI:
    if cfg.disaggregated:
        prefill, decode = Pool(list(cfg.prefill), "prefill"), Pool(list(cfg.decode), "decode")
        pools = [prefill, decode]
    else:
        decode = Pool(list(cfg.backends), "replica")
        prefill, pools = None, [decode]
    reg = CollectorRegistry()
    requests = Counter("blitz_router_requests", "requests sent to each backend, by outcome",
                       ["backend", "kind", "status"], registry=reg)
    up = Gauge("blitz_router_backend_up", "1 while the backend's /health answers 200", ["backend", "kind"],
               registry=reg)
    outstanding = Gauge("blitz_router_backend_outstanding", "requests in flight at the backend",
                        ["backend", "kind"], registry=reg)
    prefix_hits = Counter("blitz_router_prefix_routed", "requests routed by a known conversation prefix",
                          registry=reg)
    state = {}

    @asynccontextmanager
    async def lifespan(app):
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=5.0)
        client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1024,
                                                                          max_keepalive_connections=256))
        state["client"] = client
        state["proxy"] = Proxy(client, lambda b, s: requests.labels(b.url, b.kind, s).inc())
        await asyncio.gather(*(probe(client, b) for p in pools for b in p.backends))
        task = asyncio.create_task(watch(client, pools, cfg.health_interval_s))
        yield
        task.cancel()
        await client.aclose()

    app = FastAPI(title="blitz router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # (unknown paths, wrong methods)
        answer = error(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                       code="not_found" if e.status_code == 404 else None)
        path = request.url.path  # (Anthropic's clients read Anthropic's error body, as blitz serve answers them)
        return anthropic_error(answer) if path == "/v1/messages" or path.startswith("/v1/messages/") else answer

    @app.get("/health")
    async def health():
        down = [p.kind for p in pools if not p.healthy()]
        if down:
            return error(503, f"no {down[0]} backend is up", code="no_backend")
        return JSONResponse({"status": "ok", "backends": {b.url: b.kind for p in pools for b in p.healthy()}})

    @app.get("/metrics")
    async def metrics():
        for p in pools:
            for b in p.backends:
                up.labels(b.url, b.kind).set(1 if b.up else 0)
                outstanding.labels(b.url, b.kind).set(b.outstanding)
        return Response(generate_latest(reg), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    @app.get("/v1/models/{model_id:path}")
    async def models(request: Request):
        """A decode (or replica) backend's answer to the same GET."""
        b = decode.pick()
        if b is None:
            return error(503, f"no {decode.kind} backend is up; retry shortly", code="no_backend")
        try:
            r = await state["client"].get(b.url + request.url.path, headers=forward_headers(request), timeout=10.0)
        except httpx.HTTPError as e:
            b.up = False
            return error(503, f"the backend did not answer: {e}", code="no_backend")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        """Every backend's (each keeps its own prefix cache): {"reset": true} when each reset it; a
        backend's error, or a 503 naming one that did not answer, otherwise."""
        async def one(b):
            try:
                return await state["client"].post(b.url + "/reset_prefix_cache", headers=forward_headers(request),
                                                  timeout=30.0)
            except httpx.HTTPError as e:
                return e
        backends = [b for p in pools for b in p.backends]
        answers = await asyncio.gather(*(one(b) for b in backends))
        for b, r in zip(backends, answers):
            if isinstance(r, Exception):
                return error(503, f"the backend {b.url} did not answer: {r}", code="no_backend")
            if r.status_code != 200:
                return Response(r.content, status_code=r.status_code, media_type="application/json")
        return JSONResponse({"reset": all(_said_reset(r) for r in answers)})

    async def handle(request: Request, path: str):
        raw = await read_body(request, cfg.max_request_bytes)
        if isinstance(raw, Response):
            return raw
        body = parse_body(raw)
        if isinstance(body, Response):
            return body
        headers = forward_headers(request)
        stream = bool(body.get("stream"))
        proxy: Proxy = state["proxy"]
        if not cfg.disaggregated:
            keys = None
            if cfg.prefix_aware:
                keys = prefix_keys(prompt_text(body))
                known = decode.pick(keys)
                if known is not None and known.match(keys):
                    prefix_hits.inc()
            return await proxy.forward(decode, path, raw, headers, stream, request, keys=keys)
        return await disaggregated(request, path, body, headers, stream, proxy)

    async def disaggregated(request, path, body, headers, stream, proxy: Proxy):
        n = fan_out_n(body)
        if n > 1:   # n requests of one completion, their answers merged (fanout.py)
            answers = await asyncio.gather(*(disaggregated(request, path, child, headers, stream, proxy)
                                             for child in child_bodies(body, n)))
            return merge_streams(answers, request) if stream else merge_answers(answers)
        pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
        pre.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        if decode.pick() is None:
            return error(503, "no decode backend is up; retry shortly", code="no_backend")
        b, r = await proxy.post_json(prefill, path, pre, headers, request)
        if b is None:
            return error(503, "no prefill backend is up; retry shortly", code="no_backend")
        if r is None:
            return Response(status_code=499)  # the client left during the prefill
        if r is TIMED_OUT:
            return timed_out(cfg.request_timeout_s)
        if r.status_code != 200:
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        params = None
        with suppress(ValueError):
            answer = r.json()
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        dec = dict(body)
        if isinstance(params, dict):
            dec["kv_transfer_params"] = params
        else:
            dec.pop("kv_transfer_params", None)
            params = {}

        def give_back():  # a lease the consumer never claimed need not wait for kv_lease_s
            asyncio.ensure_future(proxy.release(b, params, headers))

        return await proxy.forward(decode, path, json.dumps(dec).encode(), {**headers, "content-type":
                                   "application/json"}, stream, request, after=give_back)

    install_endpoints(app, decode, state, cfg, reg)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "/v1/completions")

    return app


def _said_reset(r: httpx.Response) -> bool:
    try:
        return r.json().get("reset") is True
    except (ValueError, AttributeError):
        return False
