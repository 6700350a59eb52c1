"""``blitz serve``: the FastAPI app (routes, auth, lifecycle) and its uvicorn runner.

uvicorn starts answering at once; the engine loads in the AsyncEngine's thread and /health
turns from 503 to 200 when it is ready. A model that fails to load stops the server, and
``run_server`` raises its message (the CLI prints it and exits 2).
"""
from __future__ import annotations

import argparse
import copy
import hmac
import logging
import os
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..engine.async_engine import AsyncEngine
from .errors import APIError, install_error_handlers, parse_body, read_json
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .chat import create_chat_completion
from .completions import create_completion
from .serving import Serving

log = logging.getLogger("blitzllm.server")
DEFAULT_MAX_BODY = 8 << 20


@dataclass(frozen=True)
class ServeConfig:
    engine_kwargs: dict = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    served_model_name: Optional[str] = None
    max_waiting_requests: int = 1024
    max_request_bytes: int = DEFAULT_MAX_BODY

    @property
    def model_name(self) -> str:
        return self.served_model_name or str(self.engine_kwargs.get("model", "smollm2"))


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("BLITZ_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize "
                        "(default: $BLITZ_API_KEY, else no key)")
    g.add_argument("--served-model-name", default=None, help="the model id clients use (default: --model)")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="answer 503 + Retry-After once this many sequences are waiting")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_BODY, help="request body limit (413)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--access-log", action="store_true", help="log every request (off: it costs throughput)")


def build_app(cfg: ServeConfig, engine_factory: Optional[Callable] = None,
              on_load_error: Optional[Callable[[BaseException], None]] = None) -> FastAPI:
    """``engine_factory`` builds the Engine (default: from ``cfg.engine_kwargs``)."""
    from ..engine.engine import Engine, EngineArgs

    metrics = ServerMetrics(cfg.model_name, lambda: aengine.stats())

    def load():
        t0 = time.perf_counter()
        engine = engine_factory() if engine_factory is not None else Engine(EngineArgs(**cfg.engine_kwargs))
        tok = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        serving.setup(engine, tok)
        log.info("model %s loaded in %.1fs: max_model_len=%d, %d KV blocks", cfg.model_name,
                 time.perf_counter() - t0, engine.max_model_len, engine.kv.num_blocks)
        return engine

    aengine = AsyncEngine(load, max_waiting=cfg.max_waiting_requests, observer=metrics,
                          on_load_error=on_load_error)
    aliases = (str(cfg.engine_kwargs["model"]),) if "model" in cfg.engine_kwargs else ()
    serving = Serving(aengine, cfg.model_name, aliases)
    expected_auth = f"Bearer {cfg.api_key}".encode() if cfg.api_key else None

    @asynccontextmanager
    async def lifespan(app):
        aengine.start()
        yield
        aengine.shutdown()

    app = FastAPI(title="blitzllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.aengine, app.state.serving, app.state.metrics = aengine, serving, metrics
    install_error_handlers(app)

    def guard(request: Request, need_engine: bool = True) -> None:
        if expected_auth is not None:
            got = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(got, expected_auth):
                raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
        if need_engine and not aengine.ready:
            raise APIError(503, "the model is still loading" if aengine.load_error is None
                           else f"the model failed to load: {aengine.load_error}",
                           code="model_loading", headers={"Retry-After": "5"})

    async def body(request: Request, model):
        return parse_body(model, await read_json(request, cfg.max_request_bytes))

    def counted(status_exc: APIError):
        metrics.rejected(status_exc.status)
        return status_exc

    @app.get("/health")
    async def health():
        if aengine.ready:
            return JSONResponse({"status": "ok"})
        msg = "loading" if aengine.load_error is None else f"load failed: {aengine.load_error}"
        return APIError(503, f"the model is not ready: {msg}", code="model_loading",
                        headers={"Retry-After": "5"}).response()

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
        serving.check_model(model_id)
        return JSONResponse(serving.model_card())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            guard(request)
            return await create_chat_completion(serving, await body(request, ChatCompletionRequest), request)
        except APIError as e:
            raise counted(e)

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            guard(request)
            return await create_completion(serving, await body(request, CompletionRequest), request)
        except APIError as e:
            raise counted(e)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        guard(request)
        return JSONResponse(serving.tokenize(await body(request, TokenizeRequest)))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        guard(request)
        return JSONResponse(serving.detokenize(await body(request, DetokenizeRequest)))

    return app


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    from ..cli_args import engine_kwargs
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    if args.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes must be >= 1024, got {args.max_request_bytes}")
    return ServeConfig(engine_kwargs=engine_kwargs(args), host=args.host, port=args.port, api_key=args.api_key,
                       served_model_name=args.served_model_name, max_waiting_requests=args.max_waiting_requests,
                       max_request_bytes=args.max_request_bytes)


def run_server(args: argparse.Namespace) -> int:
    import uvicorn
    cfg = config_from_args(args)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    server: Optional[uvicorn.Server] = None
    failure: list = []

    def on_load_error(e: BaseException) -> None:
        failure.append(e)
        if server is not None:
            server.should_exit = True

    app = build_app(cfg, on_load_error=on_load_error)
    ucfg = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=args.log_level,
                          access_log=args.access_log, timeout_graceful_shutdown=5, lifespan="on")
    server = uvicorn.Server(ucfg)
    print(f"blitz serve: http://{cfg.host}:{cfg.port} (model '{cfg.model_name}' loading in the background; "
          f"/health turns 200 when ready)", file=sys.stderr, flush=True)
    try:
        server.run()
    except SystemExit as e:
        if e.code not in (0, None):
            raise ValueError(f"the server could not start on {cfg.host}:{cfg.port} (is the port in use?)") from None
    if failure:
        e = failure[0]
        if isinstance(e, ValueError):
            raise ValueError(f"failed to load the model: {e}")
        raise RuntimeError(f"failed to load the model: {type(e).__name__}: {e}")
    return 0
