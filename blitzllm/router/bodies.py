"""The router's reading of request bodies: the raw bytes under the size limit, the JSON object the
backends would read (else the 400 they would answer), and the text a conversation's prefix key is
made of. Knows nothing about backends.
"""
from __future__ import annotations

import json

from fastapi import Request

from .. import http_body
from .proxy import error


def parse_body(raw: bytes):
    """A request body as a JSON object, or an OpenAI-style 400 saying why not: UTF-8 JSON with
    finite numbers, as the backends read it (a lone surrogate's escape passes: the backend names
    its field)."""
    try:
        body = http_body.loads_finite(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return error(400, f"the request body is not valid UTF-8 (byte {e.start})", code="invalid_encoding")
    except http_body.NonFinite as e:
        return error(400, f"the request body holds a non-finite number ({e}); JSON numbers must be finite",
                     code="invalid_json")
    except (ValueError, RecursionError) as e:  # (not JSON, a number past int's digit limit, too deep)
        return error(400, f"the request body is not valid JSON: {e}", code="invalid_json")
    if not isinstance(body, dict):
        return error(400, "the request body must be a JSON object", code="invalid_json")
    return body


async def read_body(request: Request, limit: int):
    """The body's bytes, or a 413 past ``limit`` / a 400 when the client left while sending."""
    try:
        return await http_body.read_body(request, limit)
    except http_body.BodyError as e:
        return error(e.status, str(e), code=e.code)


def prompt_text(body: dict) -> str:
    """The text a conversation's prefix key is made of: chat messages in order (after Anthropic's
    ``system``), a response's ``instructions`` and ``input`` items, or the prompt."""
    if isinstance(body.get("messages"), list):
        system = f"system\x1f{json.dumps(body['system'], sort_keys=True)}\x1e" if "system" in body else ""
        return system + "".join(f"{m.get('role')}\x1f{json.dumps(m.get('content'), sort_keys=True)}\x1e"
                                for m in body["messages"] if isinstance(m, dict))
    if "input" in body:  # (a response: each input item whole, its role and content among its fields)
        items = body["input"] if isinstance(body["input"], list) else [body["input"]]
        return f"{body.get('instructions')}\x1e" + "".join(f"{json.dumps(i, sort_keys=True)}\x1e" for i in items)
    p = body.get("prompt")
    return p if isinstance(p, str) else json.dumps(p)
