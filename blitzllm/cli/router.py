"""``blitz router``: its options and the uvicorn runner (the app is ``blitzllm/router/app.py``).
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
from urllib.parse import urlsplit

from ..cli_args import check_listen_address


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL",
                   help="producer servers (blitz serve --kv-transfer-config '{\"kv_role\": \"kv_producer\"}')")
    p.add_argument("--decode", nargs="+", default=[], metavar="URL",
                   help="consumer servers (kv_role kv_consumer); goes with --prefill")
    p.add_argument("--backend", nargs="+", default=[], metavar="URL",
                   help="plain replicas to balance instead (data parallel)")
    p.add_argument("--prefix-aware", action="store_true",
                   help="with --backend: send a conversation to the replica that saw its prefix")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between backend /health polls")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a backend may take to answer (past it: 504, the backend stays in use)")
    p.add_argument("--max-request-bytes", type=int, default=8 << 20,
                   help="request body limit (413), as blitz serve's (default 8 MiB)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])


def _urls(urls: list, flag: str) -> tuple:
    for u in urls:
        if not u.startswith(("http://", "https://")) or not urlsplit(u).hostname:
            raise ValueError(f"{flag} takes http(s)://HOST[:PORT] URLs, got {u!r}")
    return tuple(urls)


def config_from_args(a: argparse.Namespace):
    from ..router.app import RouterConfig
    if bool(a.prefill) != bool(a.decode):
        raise ValueError("--prefill and --decode go together")
    if a.backend and a.prefill:
        raise ValueError("give either --prefill/--decode (disaggregated) or --backend (replicas), not both")
    if not a.backend and not a.prefill:
        raise ValueError("give --prefill URL.. --decode URL.., or --backend URL..")
    if a.prefix_aware and not a.backend:
        raise ValueError("--prefix-aware goes with --backend")
    check_listen_address(a.host, a.port)
    if a.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes must be >= 1024, got {a.max_request_bytes}")
    if not all(math.isfinite(x) and x > 0 for x in (a.health_interval, a.request_timeout)):
        raise ValueError("--health-interval and --request-timeout must be finite numbers > 0")
    return RouterConfig(prefill=_urls(a.prefill, "--prefill"), decode=_urls(a.decode, "--decode"),
                        backends=_urls(a.backend, "--backend"), prefix_aware=a.prefix_aware,
                        health_interval_s=a.health_interval, request_timeout_s=a.request_timeout,
                        max_request_bytes=a.max_request_bytes, host=a.host, port=a.port)


def run_router(a: argparse.Namespace) -> int:
    import uvicorn

    from ..router.app import build_router_app
    cfg = config_from_args(a)
    logging.basicConfig(level=getattr(logging, a.log_level.upper()), stream=sys.stderr,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    mode = (f"prefill {', '.join(cfg.prefill)} -> decode {', '.join(cfg.decode)}" if cfg.disaggregated
            else f"replicas {', '.join(cfg.backends)}{' (prefix-aware)' if cfg.prefix_aware else ''}")
    print(f"blitz router: http://{cfg.host}:{cfg.port} ({mode})", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(build_router_app(cfg), host=cfg.host, port=cfg.port,
                                           log_level=a.log_level, access_log=False, timeout_graceful_shutdown=5))
    try:
        server.run()
    except SystemExit:  # (uvicorn exits when it cannot bind; it logged why)
        pass
    if not server.started:
        raise ValueError(f"the router could not start on {cfg.host}:{cfg.port} (is the port in use?)")
    return 0
