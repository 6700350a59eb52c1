"""LoRA adapters on ``blitz serve`` (vLLM's interface): ``--lora-modules`` names adapters at start,
a request whose ``model`` names one runs under it, ``/v1/models`` lists them beside the base model
(``parent``: the base model's id, ``root``: the adapter's path), and with
``--allow-runtime-lora-updating`` ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``
add and drop them while serving (vLLM gates these behind an environment variable; here a flag).

An adapter is read and checked against the model before its name is served, so a bad one is a
400 (or a start-up failure), never a request failure later. Each load takes a fresh
``lora_int_id``: an adapter loaded again under the same name is a new adapter to the engine's
slots and prefix cache. An unload only stops new requests from naming it; running ones hold
their adapter and finish.
"""
from __future__ import annotations

import itertools
import json
import threading

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from ..lora import LoRARequest
from .errors import APIError, bad_request, decode_json


def parse_lora_modules(items) -> tuple:
    """``--lora-modules``' entries, ``name=path`` or vLLM's JSON ``{"name": ..., "path": ...}``,
    as ((name, path), ...); a ValueError naming a malformed one."""
    out = []
    for item in items or ():
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
            except ValueError as e:
                raise ValueError(f"--lora-modules: {item!r} is not valid JSON ({e})") from None
            name, path = (spec.get("name"), spec.get("path")) if isinstance(spec, dict) else (None, None)
        else:
            name, _, path = item.partition("=")
        if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path.strip():
            raise ValueError(f"--lora-modules: {item!r} must be name=path or "
                             '\'{"name": "...", "path": "..."}\'')
        out.append((name.strip(), path.strip()))
    names = [n for n, _ in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--lora-modules names {', '.join(dup)} more than once")
    return tuple(out)


class ServedLoRAs:
    """The adapters the server answers to, by name (read by the request handlers, changed by
    the load / unload routes)."""

    def __init__(self, modules: tuple = ()):
        self.modules = modules
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.manager = None   # the engine's LoRAManager, once loaded (None: no --enable-lora)

    def setup(self, engine, base_names: set) -> None:
        """In the loading thread: the ``--lora-modules`` adapters checked (a ValueError fails the
        start) and served."""
        self.manager = getattr(engine, "lora", None)
        if self.modules and self.manager is None:
            raise ValueError("--lora-modules needs --enable-lora")
        for name, path in self.modules:
            self.add(name, path, base_names)

    def get(self, name: str):
        return self.by_name.get(name)

    def add(self, name: str, path: str, base_names: set) -> LoRARequest:
        """Check and serve an adapter; a ValueError says why not."""
        if self.manager is None:
            raise ValueError("this server runs without LoRA: start it with --enable-lora")
        if name in base_names:
            raise ValueError(f"the LoRA name '{name}' is the base model's")
        with self._lock:
            if name in self.by_name:
                raise ValueError(f"the LoRA adapter '{name}' has already been loaded")
            req = LoRARequest(name, next(self._ids), path)
        self.manager.check(req)
        with self._lock:
            if name in self.by_name:   # (a concurrent load of the same name won)
                raise ValueError(f"the LoRA adapter '{name}' has already been loaded")
            self.by_name[name] = req
        return req

    def remove(self, name: str) -> bool:
        with self._lock:
            return self.by_name.pop(name, None) is not None

    @staticmethod
    def card(lora: LoRARequest, parent: str, created: int) -> dict:
        """An adapter's /v1/models entry (vLLM's: ``parent`` the base model, ``root`` its path)."""
        return {"id": lora.lora_name, "object": "model", "created": created, "owned_by": "blitzllm",
                "root": lora.lora_path, "parent": parent}

    def cards(self, parent: str, created: int) -> list:
        return [self.card(r, parent, created) for r in list(self.by_name.values())]


def install_lora_routes(app: FastAPI, serving, guard, read, allow_runtime: bool) -> None:
    """vLLM's runtime adapter routes. ``guard(request)``: the API key / readiness check;
    ``read(request)``: the raw body."""
    loras: ServedLoRAs = serving.loras

    async def body(request: Request, *fields) -> dict:
        guard(request)
        if not allow_runtime:
            raise APIError(404, "runtime LoRA updating is off: start the server with --allow-runtime-lora-updating",
                           code="lora_updating_off")
        obj = decode_json(await read(request))
        for f in fields:
            if not isinstance(obj.get(f), str) or not obj[f].strip():
                raise bad_request(f"{f} must be a non-empty string", param=f)
        return obj

    # (admin routes behind a flag, as the KV transfer's: left out of /openapi.json)
    @app.post("/v1/load_lora_adapter", include_in_schema=False)
    async def load_lora_adapter(request: Request):
        obj = await body(request, "lora_name", "lora_path")
        name = obj["lora_name"].strip()
        try:
            await serving.cpu(loras.add, name, obj["lora_path"], serving.model_names)
        except ValueError as e:
            raise bad_request(str(e), param="lora_path" if "already" not in str(e) else "lora_name",
                              code="invalid_lora") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", include_in_schema=False)
    async def unload_lora_adapter(request: Request):
        name = (await body(request, "lora_name"))["lora_name"].strip()
        if not loras.remove(name):
            raise APIError(404, f"the LoRA adapter '{name}' cannot be found", param="lora_name", code="lora_not_found")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
