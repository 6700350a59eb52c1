"""``blitz serve``: command-line options, the server config and the uvicorn runner. The app
itself is ``api.py``, imported only when serving so other commands stay light. A model that
fails to load stops the server: ``run_server`` raises its message (the CLI exits 2).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Optional

from .. import envs
from .config import DEFAULT_MAX_BODY, DEFAULT_MAX_STORED, ServeConfig


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=envs.get("BLITZ_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize "
                        "(default: $BLITZ_API_KEY, else no key)")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="answer 503 + Retry-After once this many sequences are waiting")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_BODY, help="request body limit (413)")
    g.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_STORED,
                   help="/v1/responses answers kept in memory for previous_response_id and GET (least recently "
                        "used dropped first; 0: store none)")
    g.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="answer browsers' cross-origin requests from these origins (CORS; '*' for any, or "
                        "vLLM's JSON list); default: none")
    g.add_argument("--allowed-methods", nargs="+", default=["*"], metavar="METHOD", help="CORS methods ('*')")
    g.add_argument("--allowed-headers", nargs="+", default=["*"], metavar="HEADER", help="CORS headers ('*')")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and auth headers")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    g.add_argument("--ssl-certfile", default=None, help="... and this certificate chain (PEM)")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify clients' certificates with")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                   help="client certificates: 0 not asked, 1 optional, 2 required (Python's ssl.CERT_*)")
    g.add_argument("--root-path", default=None, help="the path prefix a proxy in front serves this app under")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--access-log", action="store_true", help="log every request (off: it costs throughput)")
    g.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='prefill/decode disaggregation (docs/disaggregation.md), vLLM\'s keys: {"kv_role": '
                        '"kv_producer" | "kv_consumer" | "kv_both", "kv_connector": "NixlConnector" (default), '
                        '"kv_connector_extra_config": {...}, "kv_lease_s": 30, "kv_load_failure_policy": '
                        '"recompute" | "fail"}')
    add_model_serving_args(g)


def add_model_serving_args(g) -> None:
    """How requests are answered: options shared by ``blitz serve`` and ``blitz run-batch``."""
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model ids clients use: answers name the first, requests may name any (default: --model)")
    from .reasoning import PARSERS
    g.add_argument("--reasoning-parser", default=None, choices=PARSERS,
                   help="return a thinking model's <think> block as reasoning_content beside content in chat "
                        "completions (deepseek_r1, deepseek_v3, qwen3, minimax_m2: one rule, see "
                        "blitzllm/server/reasoning.py; minimax_m2_append_think: all in content)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a request's own chat_template (chat, /tokenize, embeddings' messages; vLLM's); "
                        "off: such a request is a 400, since its Jinja runs on the server")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="the only hosts whose http(s) image URLs are fetched (vLLM's; default: any)")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="chat and completion usages carry prompt_tokens_details.cached_tokens (the prompt tokens the "
                        "prefix cache served; vLLM's)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs' tokens as 'token_id:<id>' (vLLM's; a request's return_tokens_as_token_ids "
                        "overrides it)")
    g.add_argument("--enable-prompt-embeds", action="store_true",
                   help="completions may give vLLM's prompt_embeds (base64 torch.save'd tensors) in place of a prompt")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (docs/lora.md): a request's model names one")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help='adapters served under their names: name=path (a local PEFT folder) or \'{"name": "...", '
                        '"path": "..."}\'; needs --enable-lora')
    g.add_argument("--max-loras", type=int, default=1, help="distinct adapters in one batch (GPU slots)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank served")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept read in host memory (default --max-loras)")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    from .tools import TOOL_PARSERS
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let chat requests with tools (tool_choice 'auto') get tool_calls back; needs --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSERS,
                   help="the model's tool-call format: hermes (<tool_call>{json}</tool_call>: Qwen2.5 / Qwen3 / Hermes), "
                        "deepseek_v3, deepseek_v31 (V3.1 / V3.2), minimax_m2, qwen3_coder (Qwen3.5 / Qwen3-Coder), "
                        "llama3_json (Llama 3.1 / 3.2 / 3.3 JSON calls), pythonic ([f(a=1)]: Llama 3.2 / 4), "
                        "mistral ([TOOL_CALLS]); see docs/serving.md#tool-calls")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    from ..cli_args import check_listen_address
    check_listen_address(args.host, args.port)
    if args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    if args.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes must be >= 1024, got {args.max_request_bytes}")
    if args.max_stored_responses < 0:
        raise ValueError(f"--max-stored-responses must be >= 0, got {args.max_stored_responses}")
    _check_tls(args)
    kv = None
    if args.kv_transfer_config is not None:
        from ..kv_transfer import parse_kv_transfer_config
        kv = parse_kv_transfer_config(args.kv_transfer_config).with_address(args.host, args.port).to_dict()
    return model_serving_config(args, kv_transfer_config=kv, host=args.host, port=args.port, api_key=args.api_key,
                                max_waiting_requests=args.max_waiting_requests,
                                max_request_bytes=args.max_request_bytes,
                                max_stored_responses=args.max_stored_responses, **_cors(args))


def _names(values, flag: str) -> tuple:
    """A flag's values: plain words, or one JSON list (vLLM's form, e.g. '["*"]')."""
    if len(values) == 1 and values[0].lstrip().startswith("["):
        try:
            values = json.loads(values[0])
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} takes values or a JSON list of strings: {e}") from None
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ValueError(f"{flag} takes values or a JSON list of strings")
    if not values or not all(v.strip() for v in values):
        raise ValueError(f"{flag} needs non-empty values")
    return tuple(values)


def _cors(args: argparse.Namespace) -> dict:
    if args.allowed_origins is None:
        return {}
    return dict(allowed_origins=_names(args.allowed_origins, "--allowed-origins"),
                allowed_methods=_names(args.allowed_methods, "--allowed-methods"),
                allowed_headers=_names(args.allowed_headers, "--allowed-headers"),
                allow_credentials=args.allow_credentials)


def _check_tls(args: argparse.Namespace) -> None:
    """The TLS files exist (before the model loads); key and certificate go together."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    if args.ssl_keyfile is None and (args.ssl_ca_certs is not None or args.ssl_cert_reqs):
        raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile")
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, flag)
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--{flag.replace('_', '-')} {path}: no such file")


def model_serving_config(args: argparse.Namespace, kv_transfer_config: Optional[dict] = None,
                         **settings) -> ServeConfig:
    """The ServeConfig of ``add_model_serving_args``' options and the engine's (checked before
    any loading), with the caller's other ``settings``."""
    from ..cli_args import engine_kwargs
    names = args.served_model_name or []
    if any(not n.strip() for n in names) or len(set(names)) != len(names):
        raise ValueError("--served-model-name takes distinct, non-empty names")
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together")
    kwargs = engine_kwargs(args)
    lora_modules = _lora_kwargs(args, kwargs)
    if args.enable_prompt_embeds:
        kwargs["enable_prompt_embeds"] = True
    _check_engine(kwargs)
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config
    return ServeConfig(engine_kwargs=kwargs, served_model_name=names[0] if names else None,
                       served_model_aliases=tuple(names[1:]),
                       reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                       return_tokens_as_token_ids=args.return_tokens_as_token_ids, lora_modules=lora_modules,
                       allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                       trust_request_chat_template=args.trust_request_chat_template,
                       enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                       allowed_media_domains=tuple(args.allowed_media_domains or ()), **settings)


def _lora_kwargs(args: argparse.Namespace, kwargs: dict) -> tuple:
    """The LoRA flags into the engine's kwargs; returns the parsed --lora-modules."""
    from .lora_routes import parse_lora_modules
    modules = parse_lora_modules(args.lora_modules)
    if (modules or args.allow_runtime_lora_updating) and not args.enable_lora:
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    if args.enable_lora:
        kwargs.update(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                      max_cpu_loras=args.max_cpu_loras)
    return modules


def _check_engine(kwargs: dict) -> None:
    """The engine arguments' types and ranges, and a local model's presence, before the server
    listens (a hub model downloads afterwards, while /health answers 503)."""
    from ..engine.args import check_engine_args, sampling_defaults
    from ..engine.engine import EngineArgs
    from ..loader.source import is_hub_id, resolve_model
    args = EngineArgs(**kwargs)
    check_engine_args(args)
    if not is_hub_id(kwargs["model"]):
        sampling_defaults(args, resolve_model(kwargs["model"], kwargs["load_format"]).generation_config)


def run_server(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C / SIGTERM: HTTP in a background thread (its own event loop); once it
    listens (a taken port fails fast, before any loading), the engine loads and steps in this,
    the main thread, where signals can stop its loop cleanly."""
    import uvicorn

    from .api import build_app
    cfg = config_from_args(args)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    server: Optional[uvicorn.Server] = None
    failure: list = []

    def on_load_error(e: BaseException) -> None:
        failure.append(e)
        if server is not None:
            server.should_exit = True

    app = build_app(cfg, on_load_error=on_load_error, engine_thread=False)
    aengine = app.state.aengine
    tls = dict(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
               ssl_cert_reqs=args.ssl_cert_reqs) if args.ssl_keyfile else {}
    ucfg = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=args.log_level, root_path=args.root_path or "",
                          access_log=args.access_log, timeout_graceful_shutdown=5, lifespan="on", **tls)
    server = uvicorn.Server(ucfg)
    http = threading.Thread(target=server.run, name="blitz-http", daemon=True)
    http.start()
    while not server.started and http.is_alive():
        time.sleep(0.02)
    if not server.started:  # uvicorn logged why (typically the port is taken)
        aengine.shutdown()
        http.join(10)
        raise ValueError(f"the server could not start on {cfg.host}:{cfg.port} (is the port in use?)")
    print(f"blitz serve: {'https' if tls else 'http'}://{cfg.host}:{cfg.port} (model '{cfg.model_name}' loading; "
          f"/health turns 200 when ready)", file=sys.stderr, flush=True)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        aengine.run_forever()   # returns after a load failure or once the server stops
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        aengine.shutdown()
        server.should_exit = True
        http.join(15)
    if aengine.fatal_error is not None:
        raise RuntimeError(f"the engine failed while serving: {aengine.fatal_error}")
    if failure:
        e = failure[0]
        if isinstance(e, ValueError):
            raise ValueError(f"failed to load the model: {e}")
        raise RuntimeError(f"failed to load the model: {type(e).__name__}: {e}")
    return 0
