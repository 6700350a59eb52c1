"""The router's view of its backends: health (polled, and marked down on a failed connection),
outstanding requests (least-outstanding choice), and the prefix index of prefix-aware routing.
Knows nothing about request bodies beyond the text a prefix key is made of.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from typing import Optional

import httpx

log = logging.getLogger("blitzllm.router")

PREFIX_CHUNK = 64          # characters per prefix-index entry
PREFIX_ENTRIES = 50_000    # entries remembered per backend (LRU)
PREFIX_MAX_CHUNKS = 4096   # a prompt's leading 256K characters key it (hashed on the event loop)


class Backend:
    def __init__(self, url: str, kind: str):
        self.url = url.rstrip("/")
        self.kind = kind            # prefill | decode | replica
        self.up = False
        self.outstanding = 0
        self.served = 0
        self.prefixes: OrderedDict[bytes, None] = OrderedDict()

    def remember(self, keys: list) -> None:
        for k in keys:
            self.prefixes[k] = None
            self.prefixes.move_to_end(k)
        while len(self.prefixes) > PREFIX_ENTRIES:
            self.prefixes.popitem(last=False)

    def match(self, keys: list) -> int:
        """How many leading prefix chunks of a prompt this backend has seen."""
        return next((i for i, k in enumerate(keys) if k not in self.prefixes), len(keys))


def prefix_keys(text: str) -> list:
    """Chained hashes of the text's leading 64-character chunks (the last partial one too), at
    most PREFIX_MAX_CHUNKS of them."""
    keys, h = [], hashlib.sha1()
    for i in range(0, min(len(text), PREFIX_CHUNK * PREFIX_MAX_CHUNKS), PREFIX_CHUNK):
        h.update(text[i:i + PREFIX_CHUNK].encode("utf-8", "surrogatepass"))
        keys.append(h.copy().digest())
    return keys


class Pool:
    """Backends of one kind; ``pick`` the least outstanding healthy one (or, with ``keys``, the
    one that saw the longest prefix of them)."""

    def __init__(self, urls: list, kind: str):
        self.backends = [Backend(u, kind) for u in urls]
        self.kind = kind

    def healthy(self) -> list:
        return [b for b in self.backends if b.up]

    def pick(self, keys: Optional[list] = None, exclude=()) -> Optional[Backend]:
        live = [b for b in self.healthy() if b not in exclude]
        if not live:
            return None
        if keys:
            best = max(live, key=lambda b: (b.match(keys), -b.outstanding))
            if best.match(keys) > 0:
                return best
        return min(live, key=lambda b: (b.outstanding, b.served))


async def probe(client: httpx.AsyncClient, b: Backend, timeout: float = 2.0) -> bool:
    try:
        r = await client.get(b.url + "/health", timeout=timeout)
        ok = r.status_code == 200
    except httpx.HTTPError:
        ok = False
    if ok != b.up:
        log.warning("backend %s (%s) is %s", b.url, b.kind, "up" if ok else "down")
    b.up = ok
    return ok


async def watch(client: httpx.AsyncClient, pools: list, interval: float) -> None:
    """Poll every backend's /health forever (a down one comes back when it answers 200)."""
    while True:
        await asyncio.gather(*(probe(client, b) for p in pools for b in p.backends))
        await asyncio.sleep(interval)
