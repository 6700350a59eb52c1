"""Reading an HTTP request's body under a size limit, and its JSON with finite numbers only, for
the OpenAI server and the router, which answer the failures each in their own error form."""
from __future__ import annotations

import json

from starlette.requests import ClientDisconnect, Request


class NonFinite(ValueError):
    """A JSON number that is not finite (NaN, Infinity, or a literal past the float range)."""


def _no_constant(name: str):
    raise NonFinite(name)


def _finite_float(text: str) -> float:
    x = float(text)
    if x != x or x in (float("inf"), float("-inf")):
        raise NonFinite(text)
    return x


def loads_finite(text: str):
    """``json.loads`` refusing non-finite numbers (NonFinite, a ValueError), which Python's json
    reads but JSON does not allow."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)


class BodyTooLarge(ValueError):
    """The body (by its Content-Length, else as read) is over the limit."""


class ClientGone(Exception):
    """The client disconnected before its body ended."""


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body; BodyTooLarge past ``limit`` bytes, ClientGone when the sender left, ValueError
    for a Content-Length that is not a number."""
    cl = request.headers.get("content-length")
    if cl is not None and int(cl) > limit:   # (int() of a bad header: the ValueError)
        raise BodyTooLarge(f"the request body ({cl} bytes) exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"the request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)
