"""Assertions shared by the server tests."""
from __future__ import annotations

import json
import time

import httpx
import openai


def check_error(r: httpx.Response, status: int, param) -> dict:
    """An OpenAI-style error body with the given status (and param, when not None)."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


def stream_chat(url: str, body: dict, timeout: float = 120) -> tuple:
    """A streamed chat completion's deltas joined: ({"reasoning_content", "content"}, the tool
    call deltas in order, the finish_reason)."""
    parts, calls, reason = {"reasoning_content": "", "content": ""}, [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    for key in parts:
                        parts[key] += ch["delta"].get(key) or ""
                    calls += ch["delta"].get("tool_calls") or []
                    reason = ch["finish_reason"] or reason
    return parts, calls, reason


def client(srv) -> openai.OpenAI:
    """The official client on a test server."""
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.api_key or "unused", max_retries=0, timeout=300)


def tokens_of(srv, **body) -> int:
    """The prompt's token count by /tokenize (``prompt`` or ``messages``)."""
    r = httpx.post(srv.url + "/tokenize", json=body, headers=srv.headers(), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def wait_idle(srv, timeout: float = 5.0) -> dict:
    """Metrics once nothing runs, waits or holds a KV block (asserts it happens in time)."""
    deadline = time.monotonic() + timeout
    while True:
        m = srv.metrics()
        idle = (m["blitz_num_requests_running"] == 0 and m["blitz_num_requests_waiting"] == 0
                and m["blitz_kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def rejected(srv) -> float:
    """The refusals counted in the metrics, every status together."""
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("blitz_request_rejected_total{"))


def drop_stream_midway(srv, path: str, body: dict, is_delta) -> None:
    """Stream ``body`` to ``path``, read three lines ``is_delta`` says are text deltas (the
    request then holds KV blocks and runs), disconnect: asserts the request is aborted and its
    blocks are free within 2 s."""
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", srv.url + path, json=body, headers=srv.headers()) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            it = r.iter_lines()   # (kept alive: dropping it closes the connection, the disconnect below)
            deltas = 0
            while deltas < 3:
                deltas += bool(is_delta(next(it)))
            held = srv.metrics()
            assert held["blitz_kv_cache_usage_perc"] > 0 and held["blitz_num_requests_running"] == 1
            del it
    t0 = time.monotonic()
    m = wait_idle(srv, timeout=2.0)
    assert m["blitz_kv_cache_blocks_free"] == m["blitz_kv_cache_blocks_total"] and m["blitz_num_requests_running"] == 0
    assert time.monotonic() - t0 <= 2.0


# what differs between two runs of one request: ids, times, the prefix cache's hits, parsed copies
RUN_SPECIFIC = {"id", "created_at", "call_id", "cached_tokens", "parsed", "parsed_arguments"}


def same(resp) -> dict:
    """A response (JSON, or an SDK model) without what differs between two runs of one request."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in RUN_SPECIFIC}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return strip(resp if isinstance(resp, (dict, list)) else resp.model_dump(mode="json"))
