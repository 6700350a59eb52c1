"""The control plane of KV transfer on ``blitz serve`` (docs/disaggregation.md): a consumer
claims a producer's lease (``POST /kv_transfer/claim``; the blocks then move over the
connector's transport, not HTTP), a router gives up on one (``POST /kv_transfer/release``), and
``GET /kv_transfer/info`` names the engine's role and cache layout. Thin: the connector
(``blitzllm/kv_transfer``) holds the leases.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .errors import APIError, decode_json


def install_kv_routes(app: FastAPI, aengine, guard, read) -> None:
    """``guard(request)``: the API key / readiness check; ``read(request)``: the raw body."""

    def connector():
        conn = getattr(aengine.engine, "connector", None)
        if conn is None:
            raise APIError(404, "this server has no --kv-transfer-config", code="kv_transfer_off")
        return conn

    async def guarded_lease(request: Request) -> dict:
        guard(request)
        body = decode_json(await read(request))
        if not isinstance(body.get("lease"), str):  # (decode_json gives an object)
            raise APIError(400, "the body must be an object with a string 'lease'", param="lease")
        return body

    @app.get("/kv_transfer/info", include_in_schema=False)
    async def kv_info(request: Request):
        guard(request)
        return JSONResponse(connector().info())

    @app.post("/kv_transfer/claim", include_in_schema=False)
    async def kv_claim(request: Request):
        body = await guarded_lease(request)
        out = connector().claim(body["lease"], bool(body.get("agent_metadata")))
        if out is None:
            raise APIError(404, f"no KV lease {body['lease']!r} to claim (expired, released or claimed)",
                           code="kv_lease_gone")
        return JSONResponse(out)

    @app.post("/kv_transfer/release", include_in_schema=False)
    async def kv_release(request: Request):
        body = await guarded_lease(request)
        return JSONResponse({"released": connector().release(body["lease"])})
