"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` for every
failure (Anthropic's ``{"type": "error", "error": {"type", "message"}}`` on the Messages API's
routes), the exception handlers that guarantee it (no FastAPI 422s, no bare 500s for client
mistakes), and the size-limited JSON body reader."""
from __future__ import annotations

import json
import logging
import re
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import http_body

log = logging.getLogger("blitzllm.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable_error"}

# Anthropic's error types by status (its 529 overloaded_error is this server's 503)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_ROUTES = "/v1/messages"   # the Messages API's routes: this path and those below it


def anthropic_route(path: str) -> bool:
    return path == ANTHROPIC_ROUTES or path.startswith(ANTHROPIC_ROUTES + "/")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, type: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self, request_id: Optional[str] = None) -> dict:
        """Anthropic's error body: no ``param`` field, so the message names it."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        message = self.message
        if self.param and not message.startswith((self.param, f"'{self.param}'")):
            message = f"{self.param}: {message}"
        return {"type": "error", "error": {"type": kind, "message": message}, "request_id": request_id}

    def response(self, request: Optional[Request] = None) -> JSONResponse:
        """The error's response; with ``request``, in the shape of its route's API."""
        body = self.body()
        if request is not None and anthropic_route(request.url.path):
            body = self.anthropic_body(getattr(request.state, "request_id", None))
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "model", "function-after"}


def _loc(loc) -> Optional[str]:
    """Dotted field path, without pydantic's union member tags (``str``, ``list[int]``...; a
    Responses input item's ``item:...``)."""
    parts = [str(p) for p in loc if p != "body" and not (isinstance(p, str) and (
        p in _TYPE_TAGS or "[" in p or p.startswith(("function-", "is-instance", "tagged-union", "constrained-",
                                                     "item:"))))]
    return ".".join(parts) or None


def from_validation_error(err) -> APIError:
    """The first pydantic error, as a 400 naming the field."""
    errs = err.errors()
    e = errs[0] if errs else {"loc": (), "msg": str(err)}
    param = _loc(e.get("loc", ()))
    if e.get("type") == "missing":
        return bad_request(f"'{param}' is a required field", param=param, code="missing_field")
    msg = e.get("msg", "invalid value")
    if len(errs) > 1 and param:  # a union: no single member message fits, name the field
        msg = "invalid type or value"
    got = e.get("input")
    got_s = f" (got {json.dumps(got)[:80]})" if _jsonable(got) and not isinstance(got, dict) else ""
    return bad_request(f"{param}: {msg}{got_s}" if param else f"{msg}{got_s}", param=param, code="invalid_value")


def _jsonable(x) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False


async def read_body(request: Request, limit: int) -> bytes:
    """The raw request body; 413 over ``limit`` bytes (by Content-Length, else while reading)."""
    try:
        return await http_body.read_body(request, limit)
    except http_body.BodyError as e:
        raise APIError(e.status, str(e), code=e.code) from None


# a JSON escape of a UTF-16 surrogate (\uD800-\uDFFF): only then can the parsed text hold one
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _surrogate_path(obj, path: tuple) -> Optional[tuple]:
    """The path of the first string (or key) in ``obj`` holding a lone surrogate, else None."""
    if isinstance(obj, str):
        return path if _SURROGATE.search(obj) else None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        if isinstance(k, str) and _SURROGATE.search(k):
            return path
        found = _surrogate_path(v, path + (k,))
        if found is not None:
            return found
    return None


def decode_json(raw: bytes) -> dict:
    """A request body as a JSON object: 400 when not UTF-8 JSON, when a number is not finite, or
    when text holds a lone UTF-16 surrogate (tokenizers cannot encode it: a 400 naming the field)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from None
    if not text.strip():
        raise bad_request("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        obj = http_body.loads_finite(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                          code="invalid_json") from None
    except http_body.NonFinite as e:
        raise bad_request(f"the request body holds a non-finite number ({e}); JSON numbers must be finite",
                          code="invalid_json") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply", code="invalid_json") from None
    except ValueError as e:  # an integer literal past Python's digit limit for int()
        raise bad_request(f"the request body holds a number that cannot be read: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):
        path = _surrogate_path(obj, ())
        if path is not None:
            param = ".".join(str(p) for p in path) or None
            raise bad_request(f"{param or 'the request body'}: the text holds a lone UTF-16 surrogate (an unpaired "
                              "\\uD800-\\uDFFF escape), which is not a Unicode character", param=param,
                              code="invalid_unicode")
    return obj


def parse_body(model: type[BaseModel], obj: dict) -> BaseModel:
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response(request)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return from_validation_error(exc).response(request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else "HTTP error"
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        return APIError(exc.status_code, msg, headers=getattr(exc, "headers", None)).response(request)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        rid = getattr(request.state, "request_id", None)
        log.exception("unhandled error on %s %s (request %s)", request.method, request.url.path, rid)
        # Connection: close, as Starlette re-raises the error after this response and the server
        # then drops the connection: a client reusing it would meet a reset on its next request
        headers = {"Connection": "close", **({"X-Request-Id": rid} if rid else {})}
        return APIError(500, f"internal server error: {type(exc).__name__}", type="server_error",
                        headers=headers).response(request)
