"""``blitz run-batch``: a file of requests in OpenAI's Batch API format (vLLM's ``run-batch``)
answered offline. Each input line is ``{"custom_id", "method": "POST", "url", "body"}``; each
output line, in the input's order, ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}``: a refused request has ``status_code`` 4xx, ``body`` null
and the server's error object in ``error``, as vLLM writes it.

The requests go through ``blitz serve``'s own app, in this process and without a socket, so a
body is validated, answered and refused exactly as the server would; up to twice
``max_num_seqs`` of them are in flight at once, so the engine batches them. The whole input is
checked before the model loads: a line that is not such an object, a repeated ``custom_id`` or
an endpoint we do not serve stops the run with one line naming it (the CLI exits 2).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from typing import Optional

# the endpoints a batch line may name (vLLM's run-batch: chat, embeddings, score, rerank;
# OpenAI's Batch API adds completions and responses; a classifier's /classify)
URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/score", "/score",
        "/v1/rerank", "/rerank", "/v2/rerank", "/classify")


def add_run_batch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--input-file", required=True,
                   help="the requests, one JSON object a line: a local path or an http(s) URL (read by GET)")
    p.add_argument("-o", "--output-file", required=True,
                   help="where the answers go: a local path or an http(s) URL (sent by PUT once all are done)")
    p.add_argument("--output-tmp-dir", default=None,
                   help="folder of the temporary file an http(s) --output-file is written to before its upload")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at once (default: twice --max-num-seqs)")
    from .app import add_model_serving_args
    add_model_serving_args(p.add_argument_group("serving"))


def _is_url(path: str) -> bool:
    return path.startswith(("http://", "https://"))


def read_input(path: str) -> str:
    if _is_url(path):
        import httpx
        try:
            r = httpx.get(path, timeout=300, follow_redirects=True)
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise ValueError(f"cannot read --input-file {path}: {e}") from None
        return r.text
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --input-file {path}: {e}") from None


def parse_batch(text: str) -> list:
    """The input's requests as (line number, custom_id, url, body); a ValueError names the first
    line that is not one."""
    out, seen = [], set()
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            item = e
        if not isinstance(item, dict):
            why = item if isinstance(item, ValueError) else f"a JSON {type(item).__name__}"
            raise ValueError(f"input line {n} is not a JSON object ({why})")
        cid, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
        if not isinstance(cid, str) or not cid:
            raise ValueError(f"input line {n}: custom_id must be a non-empty string")
        if cid in seen:
            raise ValueError(f"input line {n}: custom_id {cid!r} is used twice (each must be unique)")
        if method != "POST":
            raise ValueError(f"input line {n}: method must be \"POST\", got {method!r}")
        if url not in URLS:
            raise ValueError(f"input line {n}: url {url!r} is not one of {', '.join(URLS)}")
        if not isinstance(body, dict):
            raise ValueError(f"input line {n}: body must be a JSON object")
        extra = set(item) - {"custom_id", "method", "url", "body"}
        if extra:
            raise ValueError(f"input line {n}: unknown key(s) {', '.join(sorted(extra))}")
        seen.add(cid)
        out.append((n, cid, url, body))
    if not out:
        raise ValueError("the input file holds no requests")
    return out


def _line(custom_id: str, status: int, request_id: str, body: Optional[dict], error) -> str:
    return json.dumps({"id": f"batch-req-{uuid.uuid4().hex}", "custom_id": custom_id,
                       "response": {"status_code": status, "request_id": request_id, "body": body},
                       "error": error}, ensure_ascii=False)


async def _answer(client, cid: str, url: str, body: dict) -> tuple:
    """(ok, the output line) of one request."""
    if body.get("stream"):
        from .errors import bad_request
        return False, _line(cid, 400, uuid.uuid4().hex, None,
                            bad_request("a batch request must not be sent in stream mode", param="stream").body())
    r = await client.post(url, json=body)
    rid = r.headers.get("x-request-id", "")
    try:
        data = r.json()
    except ValueError:
        data = {"error": {"message": r.text, "type": "server_error", "param": None, "code": None}}
    if r.status_code == 200:
        return True, _line(cid, 200, rid, data, None)
    return False, _line(cid, r.status_code, rid, None, data)


class _InOrder:
    """Lines written in input order as soon as the ones before them are done; the ones that
    finish early wait here (as many as are out of order, at most)."""

    def __init__(self, out, total: int):
        self.out, self.total = out, total
        self.done: dict = {}
        self.next = self.ok = 0
        self.shown = time.monotonic()

    def add(self, i: int, result: tuple) -> None:
        self.done[i] = result
        while self.next in self.done:
            good, line = self.done.pop(self.next)
            self.out.write(line + "\n")
            self.ok, self.next = self.ok + good, self.next + 1
        if time.monotonic() - self.shown > 10:
            self.out.flush()
            print(f"blitz run-batch: {self.next}/{self.total} done", file=sys.stderr, flush=True)
            self.shown = time.monotonic()


async def _run(app, requests: list, out, concurrency: Optional[int]) -> tuple:
    """Answer ``requests`` through ``app``, at most ``concurrency`` (default twice max_num_seqs)
    in flight, each line written to ``out`` in input order (``_InOrder``); (answered, refused)."""
    import httpx
    aengine = app.state.aengine
    async with app.router.lifespan_context(app):
        while not aengine.ready and aengine.load_error is None:
            await asyncio.sleep(0.05)
        if aengine.load_error is not None:
            e = aengine.load_error
            raise ValueError(f"failed to load the model: {e}" if isinstance(e, ValueError) else
                             f"failed to load the model: {type(e).__name__}: {e}")
        sem = asyncio.Semaphore(concurrency or 2 * aengine.engine.sched_config.max_num_seqs)
        writer = _InOrder(out, len(requests))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:

            async def one(i, cid, url, body):
                try:
                    writer.add(i, await _answer(client, cid, url, body))
                finally:
                    sem.release()

            tasks: set = set()
            try:
                for i, (_, cid, url, body) in enumerate(requests):
                    await sem.acquire()   # (a task is made only when it may run: memory stays flat)
                    task = asyncio.create_task(one(i, cid, url, body))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
    if aengine.fatal_error is not None:
        raise RuntimeError(f"the engine failed: {aengine.fatal_error}")
    return writer.ok, writer.next - writer.ok


def _upload(path: str, url: str) -> None:
    import httpx
    with open(path, "rb") as f:
        try:
            r = httpx.put(url, content=f, timeout=1000)
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise ValueError(f"cannot upload the output to {url}: {e} (the answers are in {path})") from None


def run_batch(args: argparse.Namespace) -> int:
    from .api import build_app
    from .app import model_serving_config
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.output_tmp_dir is not None and not os.path.isdir(args.output_tmp_dir):
        raise ValueError(f"--output-tmp-dir {args.output_tmp_dir} is not a folder")
    requests = parse_batch(read_input(args.input_file))
    cfg = model_serving_config(args, max_waiting_requests=1 << 30, max_stored_responses=0)
    upload = _is_url(args.output_file)
    if upload:
        fd, path = tempfile.mkstemp(prefix="blitz-batch-", suffix=".jsonl", dir=args.output_tmp_dir)
        os.close(fd)
    else:
        path = args.output_file
    t0 = time.perf_counter()
    try:
        out = open(path, "w", encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot write --output-file {path}: {e}") from None
    with out:
        ok, refused = asyncio.run(_run(build_app(cfg), requests, out, args.max_concurrency))
    if upload:
        _upload(path, args.output_file)
        os.unlink(path)
    print(f"blitz run-batch: {ok + refused} requests ({ok} answered, {refused} refused) in "
          f"{time.perf_counter() - t0:.1f}s -> {args.output_file}", file=sys.stderr)
    return 0
