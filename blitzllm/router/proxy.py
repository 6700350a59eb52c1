"""Moving one request through the router: the prefill hop of a disaggregated request (the
producer answers one token and ``kv_transfer_params``), the forward of a request to one backend
(streamed or whole, retried on another backend while no byte has left, or pinned to one), showing
the JSON of an answer (or of a stream's first events) to a caller that wants to read it, and giving
a lease back when the decode never claimed it. Knows nothing about routes or health polling.
"""
from __future__ import annotations

import json
import logging
from contextlib import suppress
from typing import Awaitable, Callable, Optional

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..http_body import until_done_or_gone
from .backends import Backend, Pool

log = logging.getLogger("blitzllm.router")
# (x-api-key and anthropic-*: Anthropic's clients authenticate and version themselves with these)
_PASS_HEADERS = ("authorization", "x-api-key", "anthropic-version", "anthropic-beta", "x-request-id", "content-type")
_BACK_HEADERS = ("content-type", "x-request-id", "retry-after")
TIMED_OUT = object()   # ``Proxy._send``'s answer when the backend took past the request timeout
_POLL_S = 0.25         # how often a request waiting on a backend checks that its client is still there
_SCAN_EVENTS = 8       # a stream's leading events shown to ``seen`` (the ids sit in the first ones)
_SCAN_BYTES = 32 << 20  # ...and the most bytes buffered for them (an event echoes the request's instructions)

# ``seen(backend, obj)``: shown a 200 answer's JSON object, or a stream's leading events' data, one by
# one until it returns True
Seen = Callable[[Backend, dict], bool]


class RouterError(JSONResponse):
    """An error the router answers itself (a backend's errors are relayed as they came)."""


def error(status: int, message: str, code: Optional[str] = None, param: Optional[str] = None) -> RouterError:
    """An OpenAI-style error body."""
    kind = "invalid_request_error" if status < 500 else ("service_unavailable" if status == 503 else "server_error")
    headers = {"Retry-After": "1"} if status == 503 else None
    return RouterError({"error": {"message": message, "type": kind, "param": param, "code": code}},
                       status_code=status, headers=headers)


# Anthropic's error types by status, as ``blitz serve`` answers on /v1/messages (its 503 is Anthropic's 529
# overloaded_error)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    405: "invalid_request_error", 413: "request_too_large", 503: "overloaded_error"}


def anthropic_error(resp: Response) -> Response:
    """The router's own error in Anthropic's shape (the Messages API's clients parse that one); any
    other answer as it is."""
    if not isinstance(resp, RouterError):
        return resp
    message = json.loads(resp.body)["error"]["message"]
    kind = _ANTHROPIC_TYPES.get(resp.status_code, "api_error" if resp.status_code >= 500 else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=resp.status_code,
                        headers={k: v for k, v in resp.headers.items() if k.lower() == "retry-after"})


def broken_stream_event(style: str, message: str) -> bytes:
    """The last event of a stream whose backend broke off, in the shape of the stream's API."""
    if style == "anthropic":
        body = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
    if style == "responses":
        body = {"type": "error", "code": "backend_error", "message": message, "param": None}
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "backend_error"}}
    return f"data: {json.dumps(body)}\n\n".encode()


def forward_headers(request: Request) -> dict:
    return {k: v for k, v in request.headers.items() if k.lower() in _PASS_HEADERS}


def timed_out(request_timeout: Optional[float]) -> JSONResponse:
    return error(504, f"the backend did not answer within the router's --request-timeout ({request_timeout} s)",
                 code="backend_timeout")


def _reply(r: httpx.Response, content: bytes) -> Response:
    return Response(content, status_code=r.status_code,
                    headers={k: v for k, v in r.headers.items() if k.lower() in _BACK_HEADERS})


class Proxy:
    def __init__(self, client: httpx.AsyncClient, on_result: Callable[[Backend, str], None]):
        self.client = client
        self.on_result = on_result   # (backend, status label) for the metrics

    async def _send(self, pool: Pool, keys: Optional[list], request: Request,
                    send: Callable[[Backend], Awaitable[httpx.Response]], pin: Optional[Backend] = None) -> tuple:
        """``send`` to a healthy backend of ``pool`` (``pool.pick``), the next one when the connection
        fails: (backend, response), its outstanding count still raised; (backend, None) when the
        client went away first; (backend, TIMED_OUT) past the request timeout (a slow backend is
        neither down nor worth a second try); (None, None) when no backend is left. With ``pin``
        only that backend is tried (it holds state the others lack)."""
        tried = []
        while True:
            b = pool.pick(keys, exclude=tried) if pin is None else (None if tried else pin)
            if b is None:
                return None, None
            tried.append(b)
            if keys:
                b.remember(keys)
            b.outstanding += 1
            b.served += 1
            try:
                r = await until_done_or_gone(request, send(b), _POLL_S)
            except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout):
                b.outstanding -= 1
                self.on_result(b, "timeout")
                log.warning("backend %s did not answer within the request timeout", b.url)
                return b, TIMED_OUT
            except httpx.TransportError as e:
                b.outstanding -= 1
                b.up = False
                self.on_result(b, "unreachable")
                log.warning("backend %s failed: %s", b.url, e)
                continue
            except BaseException:
                b.outstanding -= 1
                raise
            if r is None:
                b.outstanding -= 1
            self.on_result(b, "client_gone" if r is None else str(r.status_code))
            return b, r

    async def post_json(self, pool: Pool, path: str, body: dict, headers: dict,
                        request: Request) -> tuple[Optional[Backend], Optional[httpx.Response]]:
        """POST ``body`` to a healthy backend of ``pool`` (least outstanding), the next one when
        the connection fails; (None, None) when none is left, (backend, None) when the client went away."""
        # (json.dumps escapes a lone surrogate, which the backend then refuses by name; httpx's own
        # encoding raised on it)
        content, headers = json.dumps(body).encode(), {**headers, "content-type": "application/json"}
        b, r = await self._send(pool, None, request,
                                lambda b: self.client.post(b.url + path, content=content, headers=headers))
        if r is not None and r is not TIMED_OUT:
            b.outstanding -= 1
        return b, r

    async def forward(self, pool: Pool, path: str, content: Optional[bytes], headers: dict, stream: bool,
                      request: Request, keys: Optional[list] = None, after: Optional[Callable[[], None]] = None,
                      method: str = "POST", pin: Optional[Backend] = None, seen: Optional[Seen] = None,
                      style: str = "openai") -> Response:
        """Send the body to one backend (``pin``, or any of ``pool``) and relay its answer (SSE chunks
        as they come); ``path`` may carry a query. ``after`` runs once the backend has answered its
        headers, or failed, or the client left; ``seen`` is shown the answer's JSON; ``style`` (openai,
        responses, anthropic) shapes the event that ends a stream the backend broke off."""
        try:
            b, r = await self._send(pool, keys, request, lambda b: self.client.send(
                self.client.build_request(method, b.url + path, content=content, headers=headers), stream=True),
                pin=pin)
        finally:
            if after is not None:
                after()
        if b is None and pin is not None:  # (the one backend that may answer refused the connection)
            return error(503, f"the backend {pin.url} is down; retry when it is back", code="backend_down")
        if b is None:
            return error(503, f"no {pool.kind} backend is up; retry shortly", code="no_backend")
        if r is None:  # the client left before the backend answered
            return Response(status_code=499)
        if r is TIMED_OUT:
            return timed_out(self.client.timeout.read)
        if not stream or r.status_code != 200:
            try:
                data = await until_done_or_gone(request, r.aread(), _POLL_S)
            except httpx.TimeoutException:
                return timed_out(self.client.timeout.read)
            except httpx.HTTPError as e:  # (the backend went away while sending its answer)
                return error(502, f"the backend's answer broke off: {e}", code="backend_error")
            finally:
                await r.aclose()
                b.outstanding -= 1
            if seen is not None and r.status_code == 200 and data:
                with suppress(ValueError, RecursionError):
                    obj = json.loads(data)
                    if isinstance(obj, dict):
                        seen(b, obj)
            return _reply(r, data or b"")
        return StreamingResponse(self._relay(r, b, seen, style), status_code=200, media_type="text/event-stream",
                                 headers={k: v for k, v in r.headers.items() if k.lower() == "x-request-id"})

    @staticmethod
    async def _relay(r: httpx.Response, b: Backend, seen: Optional[Seen], style: str):
        """The backend's stream, chunk by chunk; closing it (the client left) closes the backend's."""
        scan = _EventScanner(b, seen) if seen is not None else None
        try:
            async for chunk in r.aiter_raw():
                if scan is not None and not scan.feed(chunk):
                    scan = None
                yield chunk
        except httpx.HTTPError as e:
            yield broken_stream_event(style, f"the backend stream broke: {e}")
        finally:
            await r.aclose()
            b.outstanding -= 1

    async def release(self, b: Backend, params: dict, headers: dict) -> None:
        """Give a producer's lease back (best effort; a no-op once the consumer pulled it)."""
        lease = params.get("remote_request_id")
        if not lease:
            return
        try:
            await self.client.post(b.url + "/kv_transfer/release", json={"lease": lease},
                                   headers={k: v for k, v in headers.items() if k.lower() == "authorization"},
                                   timeout=5.0)
        except httpx.HTTPError:
            pass


class _EventScanner:
    """Shows ``seen`` the data of a stream's leading SSE events (``_SCAN_EVENTS`` at most, and no
    more than ``_SCAN_BYTES`` buffered), so the relay parses only the first few, never every token's."""

    def __init__(self, b: Backend, seen: Seen):
        self.b, self.seen, self.buf, self.events = b, seen, b"", 0

    def feed(self, chunk: bytes) -> bool:
        """False once it is done (or gave up): the caller stops feeding it."""
        self.buf += chunk.replace(b"\r\n", b"\n")   # (a CRLF split between two chunks only delays an event)
        while b"\n\n" in self.buf:
            event, self.buf = self.buf.split(b"\n\n", 1)
            self.events += 1
            data = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
            obj = None
            with suppress(ValueError, RecursionError):
                obj = json.loads(data) if data else None
            if isinstance(obj, dict) and self.seen(self.b, obj):
                return False
            if self.events >= _SCAN_EVENTS:
                return False
        return len(self.buf) <= _SCAN_BYTES
