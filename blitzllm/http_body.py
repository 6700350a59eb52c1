"""Reading an HTTP request's body under a size limit, for the OpenAI server and the router, which
answer its two failures each in their own error form."""
from __future__ import annotations

from starlette.requests import ClientDisconnect, Request


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
