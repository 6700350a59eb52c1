"""The FastAPI app of ``blitz serve``: routes, API-key guard, lifecycle (the engine starts
loading in the background when the app starts; /health is 503 until it is ready)."""
from __future__ import annotations

import asyncio
import copy
import hmac
import logging
import re
import time
import uuid
from contextlib import asynccontextmanager
from typing import Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..engine.async_engine import AsyncEngine
from .config import ServeConfig
from .chat import create_chat_completion
from .completions import create_completion
from .classify import ClassificationRequest, create_classify
from .embeddings import create_embedding, embedding_model
from .errors import APIError, decode_json, install_error_handlers, parse_body, read_body
from .messages import count_tokens, create_message
from .messages_protocol import CountTokensRequest, MessagesRequest
from .metrics import CONTENT_TYPE, ServerMetrics
from .openapi import build_openapi
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, RerankRequest, ScoreRequest,
                       TokenizeRequest)
from .responses import cancel_response, create_response, delete_response, get_response
from .responses_protocol import ResponsesRequest
from .responses_store import ResponseStore
from .score import create_rerank, create_score
from .serving import Serving
from .tokens import detokenize_request, tokenize_request

log = logging.getLogger("blitzllm.server")

_CLIENT_ID = re.compile(r"[!-~]{1,128}")  # a client's X-Request-Id: up to 128 visible ASCII characters


class RequestIdMiddleware:
    """Every response carries ``X-Request-Id``: the client's (when it is up to 128 visible ASCII
    characters), else a fresh one; handlers read it as ``request.state.request_id``."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        text = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"x-request-id"), "")
        rid = text if _CLIENT_ID.fullmatch(text) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        header = (b"x-request-id", rid.encode())

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", ()) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("blitzllm")
    except Exception:  # noqa: BLE001 - a source tree that is not installed
        return "0"


def build_app(cfg: ServeConfig, engine_factory: Optional[Callable] = None,
              on_load_error: Optional[Callable[[BaseException], None]] = None,
              engine_thread: bool = True) -> FastAPI:
    """``engine_factory`` builds the Engine (default: from ``cfg.engine_kwargs``); with
    ``engine_thread`` the app runs it in a thread of its own, else the caller runs
    ``app.state.aengine.run_forever()`` in a thread it chooses."""
    from ..engine.engine import Engine, EngineArgs

    metrics = ServerMetrics(cfg.model_name, lambda: aengine.stats())

    def load():
        t0 = time.perf_counter()
        engine = engine_factory() if engine_factory is not None else Engine(EngineArgs(**cfg.engine_kwargs))
        tok = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        serving.setup(engine, tok)
        log.info("model %s loaded in %.1fs: max_model_len=%d, %d KV blocks (kv_cache_dtype %s)", cfg.model_name,
                 time.perf_counter() - t0, engine.max_model_len, engine.kv.num_blocks,
                 getattr(getattr(engine, "args", None), "kv_cache_dtype", "auto"))
        return engine

    aengine = AsyncEngine(load, max_waiting=cfg.max_waiting_requests, observer=metrics,
                          on_load_error=on_load_error)
    aliases = (str(cfg.engine_kwargs["model"]),) if "model" in cfg.engine_kwargs else ()
    serving = Serving(aengine, cfg.model_name, aliases + cfg.served_model_aliases, reasoning_parser=cfg.reasoning_parser,
                      tool_parser=cfg.tool_call_parser, return_tokens_as_token_ids=cfg.return_tokens_as_token_ids,
                      trust_request_chat_template=cfg.trust_request_chat_template, listed=cfg.served_model_aliases,
                      prompt_tokens_details=cfg.enable_prompt_tokens_details,
                      lora_modules=cfg.lora_modules, media_domains=cfg.allowed_media_domains)
    expected_key = cfg.api_key.encode() if cfg.api_key else None
    store = ResponseStore(cfg.max_stored_responses)   # /v1/responses' stored answers

    @asynccontextmanager
    async def lifespan(app):
        if engine_thread:
            aengine.start()
        else:
            aengine.bind(asyncio.get_running_loop())
        yield
        aengine.shutdown()
        serving.close()

    app = FastAPI(title="blitzllm", version=_version(), lifespan=lifespan, docs_url="/docs", redoc_url="/redoc",
                  openapi_url="/openapi.json",
                  description="An OpenAI-compatible server (docs/serving.md): chat and text completions, embeddings, "
                              "classification and scoring, "
                              "responses, Anthropic's messages, the model list, the server's tokenizer, health and "
                              "Prometheus metrics.")

    def openapi() -> dict:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi
            base = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            app.openapi_schema = build_openapi(base, api_key=cfg.api_key is not None)
        return app.openapi_schema

    app.openapi = openapi
    app.state.aengine = aengine
    install_error_handlers(app)
    app.add_middleware(RequestIdMiddleware)
    if cfg.allowed_origins:   # (outermost: a preflight is answered before the API-key guard)
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.allowed_origins),
                           allow_methods=list(cfg.allowed_methods), allow_headers=list(cfg.allowed_headers),
                           allow_credentials=cfg.allow_credentials)

    def key_matches(request: Request) -> bool:
        """``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key: KEY`` (Anthropic's)."""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), expected_key):
            return True
        key = request.headers.get("x-api-key")
        return key is not None and hmac.compare_digest(key.strip().encode(), expected_key)

    def guard(request: Request, need_engine: bool = True) -> None:
        if expected_key is not None and not key_matches(request):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                           code="invalid_api_key")
        if need_engine and not aengine.ready:
            raise APIError(503, "the model is still loading" if aengine.load_error is None
                           else f"the model failed to load: {aengine.load_error}",
                           code="model_loading", headers={"Retry-After": "5"})

    async def body(request: Request, model):
        """The body parsed into ``model`` (a route of two body forms: the model ``model(body)`` picks),
        in a worker thread."""
        raw = await read_body(request, cfg.max_request_bytes)

        def parse():
            obj = decode_json(raw)
            return parse_body(model if isinstance(model, type) else model(obj), obj)
        return await serving.cpu(parse)

    async def openai(request: Request, model, create):
        """A generation endpoint (OpenAI's or Anthropic's): refusals before the engine are counted
        in the metrics."""
        try:
            guard(request)
            return await create(serving, await body(request, model), request)
        except APIError as e:
            metrics.rejected(e.status)
            raise

    @app.get("/health")
    @app.get("/ping", include_in_schema=False)    # (vLLM's, for SageMaker)
    @app.post("/ping", include_in_schema=False)
    async def health():
        if aengine.ready:
            return JSONResponse({"status": "ok"})
        msg = "loading" if aengine.load_error is None else f"load failed: {aengine.load_error}"
        return APIError(503, f"the model is not ready: {msg}", code="model_loading",
                        headers={"Retry-After": "5"}).response()

    @app.get("/version")
    async def server_version():  # (vLLM's)
        return JSONResponse({"version": app.version})

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models(request: Request):
        guard(request, need_engine=False)
        return JSONResponse(serving.models())

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        guard(request, need_engine=False)
        lora = serving.check_model(model_id)
        return JSONResponse(serving.model_card(model_id if model_id in serving.listed else None) if lora is None else
                            serving.loras.card(lora, serving.model_name, serving.created))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await openai(request, ChatCompletionRequest, create_chat_completion)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await openai(request, CompletionRequest, create_completion)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await openai(request, embedding_model, create_embedding)

    @app.post("/classify")   # (vLLM's route: no /v1)
    async def classify(request: Request):
        return await openai(request, ClassificationRequest, create_classify)

    @app.post("/v1/score")
    @app.post("/score", include_in_schema=False)   # (vLLM's aliases)
    async def score(request: Request):
        return await openai(request, ScoreRequest, create_score)

    @app.post("/v1/rerank")
    @app.post("/rerank", include_in_schema=False)
    @app.post("/v2/rerank", include_in_schema=False)
    async def rerank(request: Request):
        return await openai(request, RerankRequest, create_rerank)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await openai(request, ResponsesRequest, lambda s, req, raw: create_response(s, req, raw, store))

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await openai(request, MessagesRequest, create_message)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request):
        guard(request)
        return JSONResponse(await count_tokens(serving, await body(request, CountTokensRequest)))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request):
        guard(request, need_engine=False)
        return JSONResponse(get_response(store, response_id))

    @app.delete("/v1/responses/{response_id}")
    async def remove_response(response_id: str, request: Request):
        guard(request, need_engine=False)
        return JSONResponse(delete_response(store, response_id))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, request: Request):
        guard(request, need_engine=False)
        return JSONResponse(cancel_response(store, response_id))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        guard(request)
        return await tokenize_request(serving, await body(request, TokenizeRequest))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):  # (vLLM's)
        guard(request)
        return JSONResponse({"reset": await aengine.reset_prefix_cache()})

    @app.post("/detokenize")
    async def detokenize(request: Request):
        guard(request)
        return JSONResponse(await serving.cpu(detokenize_request, serving, await body(request, DetokenizeRequest)))

    from .kv_routes import install_kv_routes
    install_kv_routes(app, aengine, guard, lambda request: read_body(request, cfg.max_request_bytes))
    from .lora_routes import install_lora_routes
    install_lora_routes(app, serving, guard, lambda request: read_body(request, cfg.max_request_bytes),
                        cfg.allow_runtime_lora_updating)
    return app
