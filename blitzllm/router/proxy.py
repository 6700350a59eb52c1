"""Moving one request through the router: the prefill hop of a disaggregated request (the
producer answers one token and ``kv_transfer_params``), the forward of a request to one backend
(streamed or whole, retried on another backend while no byte has left), and giving a lease back
when the decode never claimed it. Knows nothing about routes or health polling.
"""
from __future__ import annotations

import json
import logging
from typing import Awaitable, Callable, Optional

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..http_body import until_done_or_gone
from .backends import Backend, Pool

log = logging.getLogger("blitzllm.router")
_PASS_HEADERS = ("authorization", "x-request-id", "content-type")
_BACK_HEADERS = ("content-type", "x-request-id", "retry-after")
TIMED_OUT = object()   # ``Proxy._send``'s answer when the backend took past the request timeout
_POLL_S = 0.25         # how often a request waiting on a backend checks that its client is still there


def error(status: int, message: str, code: Optional[str] = None, param: Optional[str] = None) -> JSONResponse:
    """An OpenAI-style error body."""
    kind = "invalid_request_error" if status < 500 else ("service_unavailable" if status == 503 else "server_error")
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


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
                    send: Callable[[Backend], Awaitable[httpx.Response]]) -> tuple:
        """``send`` to a healthy backend of ``pool`` (``pool.pick``), the next one when the connection
        fails: (backend, response), its outstanding count still raised; (backend, None) when the
        client went away first; (backend, TIMED_OUT) past the request timeout (a slow backend is
        neither down nor worth a second try); (None, None) when no backend is left."""
        tried = []
        while True:
            b = pool.pick(keys, exclude=tried)
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

    async def forward(self, pool: Pool, path: str, content: bytes, headers: dict, stream: bool, request: Request,
                      keys: Optional[list] = None, after: Optional[Callable[[], None]] = None) -> Response:
        """Send the body to one backend and relay its answer (SSE chunks as they come). ``after``
        runs once the backend has answered its headers, or failed, or the client left."""
        try:
            b, r = await self._send(pool, keys, request, lambda b: self.client.send(
                self.client.build_request("POST", b.url + path, content=content, headers=headers), stream=True))
        finally:
            if after is not None:
                after()
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
            return _reply(r, data or b"")
        return StreamingResponse(self._relay(r, b), status_code=200, media_type="text/event-stream",
                                 headers={k: v for k, v in r.headers.items() if k.lower() == "x-request-id"})

    @staticmethod
    async def _relay(r: httpx.Response, b: Backend):
        """The backend's stream, chunk by chunk; closing it (the client left) closes the backend's."""
        try:
            async for chunk in r.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            msg = {"error": {"message": f"the backend stream broke: {e}", "type": "server_error", "param": None,
                             "code": "backend_error"}}
            yield f"data: {json.dumps(msg)}\n\n".encode()
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
