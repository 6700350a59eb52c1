"""``n`` > 1 through the disaggregated router. A producer hands over the KV of one sequence, so
the router does what vLLM's P/D proxy does with such a request: n requests of one completion each,
every one its own prefill and decode hop, then one answer with n choices. Child ``i`` is seeded
as the engine seeds completion ``i`` of a seeded request (``sample_seed``), so a seeded request
gets the answer one engine would give it.

Whole answers merge into the first child's body: the choices renumbered 0..n-1, the prompt's tokens
counted once and the completions' summed. Streams interleave the children's events as they come,
each choice renumbered; the children's usage events become one, sent with a single ``[DONE]``
after the last child ends. Knows nothing about backends or hops: it gets the children's answers.
"""
from __future__ import annotations

import asyncio
import json
from contextlib import suppress
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..sampling_params import MAX_N, sample_seed

_POLL_S = 0.25   # how often a merged stream looks for its client's leaving


def fan_out_n(body: dict) -> int:
    """The children to split ``body`` into: its ``n`` when a valid count above one, else 1 (a bad
    ``n`` goes through as it is, for the backend to refuse)."""
    n = body.get("n")
    ok = isinstance(n, int) and not isinstance(n, bool) and 1 < n <= MAX_N and not body.get("use_beam_search")
    return n if ok else 1


def child_bodies(body: dict, n: int) -> list:
    """``body`` as ``n`` requests of one completion each (child i's seed as the engine's)."""
    seed = body.get("seed")
    seeded = isinstance(seed, int) and not isinstance(seed, bool)
    return [{**body, "n": 1, **({"seed": sample_seed(seed, i)} if seeded else {})} for i in range(n)]


def _merge_usage(usages: list) -> Optional[dict]:
    """One usage of the children's: the prompt's tokens once (the first child's, with its details),
    the completions' summed."""
    usages = [u for u in usages if isinstance(u, dict)]
    if not usages:
        return None
    out = dict(usages[0])
    done = sum(u.get("completion_tokens") or 0 for u in usages)
    out["completion_tokens"] = done
    out["total_tokens"] = (out.get("prompt_tokens") or 0) + done
    return out


def merge_answers(answers: list) -> Response:
    """The children's whole answers (``Response``s) as one: the first that failed as it came, else
    the first's body with every child's choice in turn, renumbered."""
    for r in answers:
        if r.status_code != 200:
            return r
    bodies = [json.loads(r.body) for r in answers]
    out = bodies[0]
    out["choices"] = [{**c, "index": i} for i, b in enumerate(bodies) for c in b.get("choices", [])]
    usage = _merge_usage([b.get("usage") for b in bodies])
    if usage is not None:
        out["usage"] = usage
    return JSONResponse(out, headers={k: v for k, v in answers[0].headers.items() if k.lower() == "x-request-id"})


def merge_streams(answers: list, request: Request) -> Response:
    """The children's answers as one stream: the first that failed before streaming as it came (the
    others closed), else their events interleaved (see the module's note) until they end or the
    client leaves."""
    failed = next((r for r in answers if not isinstance(r, StreamingResponse) or r.status_code != 200), None)
    if failed is not None:
        for r in answers:
            if isinstance(r, StreamingResponse):
                asyncio.ensure_future(_close(r.body_iterator))
        return failed
    return StreamingResponse(_interleave([r.body_iterator for r in answers], request), media_type="text/event-stream",
                             headers={k: v for k, v in answers[0].headers.items() if k.lower() == "x-request-id"})


async def _close(stream) -> None:
    """Close a child's relay that never ran: started, so its cleanup (the backend's answer closed,
    its outstanding count lowered) runs when it closes."""
    with suppress(Exception):
        await stream.__anext__()
    with suppress(Exception):
        await stream.aclose()


async def _interleave(streams: list, request: Request) -> AsyncIterator[bytes]:
    # Each child is read by a task of its own into the queue; once the client left nothing iterates
    # this generator again, so a watcher looks for that every _POLL_S and stops the children. A
    # stopped child closes its relay itself (the backend's answer closed: its decode stops).
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        buf = b""
        try:
            async for chunk in stream:
                buf = (buf + (chunk if isinstance(chunk, bytes) else chunk.encode())).replace(b"\r\n", b"\n")
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    queue.put_nowait((i, event))
        finally:
            queue.put_nowait((i, None))
            with suppress(Exception):
                await stream.aclose()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(_POLL_S)
        for t in tasks:
            t.cancel()

    watcher = asyncio.ensure_future(watch())
    usages, open_, last_usage_event = [], len(streams), None
    try:
        while open_:
            i, event = await queue.get()
            if event is None:
                open_ -= 1
                continue
            data = b"\n".join(ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:"))
            if data == b"[DONE]":
                continue
            obj = None
            with suppress(ValueError, RecursionError):
                obj = json.loads(data)
            if isinstance(obj, dict) and isinstance(obj.get("choices"), list):
                if not obj["choices"] and obj.get("usage") is not None:   # a child's closing usage event
                    usages.append(obj["usage"])
                    last_usage_event = obj
                    continue
                for c in obj["choices"]:
                    if isinstance(c, dict):
                        c["index"] = i
                event = b"data: " + json.dumps(obj).encode()
            yield event + b"\n\n"
        if last_usage_event is not None:
            yield b"data: " + json.dumps({**last_usage_event, "usage": _merge_usage(usages)}).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:   # (all ended, or this generator closed: the children still streaming are stopped)
        watcher.cancel()
        for t in tasks:
            t.cancel()
