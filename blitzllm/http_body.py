"""Reading an HTTP request's body under a size limit, and its JSON with finite numbers only, for
the OpenAI server and the router, which answer the failures each in their own error form; and
awaiting work while watching for the client to leave."""
from __future__ import annotations

import asyncio
import json
import math
from typing import Optional

from starlette.requests import ClientDisconnect, Request


class NonFinite(ValueError):
    """A JSON number that is not finite (NaN, Infinity, or a literal past the float range)."""


def _no_constant(name: str):
    raise NonFinite(name)


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise NonFinite(text)
    return x


def loads_finite(text: str):
    """``json.loads`` refusing non-finite numbers (NonFinite, a ValueError), which Python's json
    reads but JSON does not allow."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)


class BodyError(Exception):
    """Why a body could not be read, with the ``status`` and error ``code`` to answer it with."""

    def __init__(self, status: int, message: str, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.code = status, code


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body; BodyError: 413 past ``limit`` bytes (by its Content-Length, else as read), 400
    for a Content-Length that is not a number or when the sender left (a 400 no one reads, not a
    logged traceback)."""
    cl = request.headers.get("content-length")
    try:
        declared = 0 if cl is None else int(cl)
    except ValueError:
        declared = -1
    if declared < 0:
        raise BodyError(400, "invalid Content-Length header")
    if declared > limit:
        raise BodyError(413, f"the request body ({cl} bytes) exceeds the limit of {limit} bytes", "request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyError(413, f"the request body exceeds the limit of {limit} bytes", "request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise BodyError(400, "the client disconnected before the request body ended", "client_disconnected") from None
    return b"".join(chunks)


async def until_done_or_gone(request: Request, coro, poll_s: float):
    """Await ``coro``; cancel it (and return None) if the client disconnects first, as seen every
    ``poll_s`` seconds."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                return None
    finally:
        if not task.done():
            task.cancel()
