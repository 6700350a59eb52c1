"""API key, body size limit and the waiting-queue bound, on a tiny random model served with
``--api-key sesame --max-num-seqs 1 --max-waiting-requests 1 --max-request-bytes 65536``."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from server_helpers import check_error


def ok_request(srv) -> None:
    r = httpx.post(srv.url + "/v1/completions", headers=srv.headers(),
                   json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


def test_api_key(tiny_server):
    url = tiny_server.url
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    err = check_error(httpx.post(url + "/v1/completions", json=body), 401, None)
    assert err["type"] == "authentication_error"
    ok_request(tiny_server)
    check_error(httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401, None)
    ok_request(tiny_server)
    check_error(httpx.get(url + "/v1/models"), 401, None)
    check_error(httpx.post(url + "/tokenize", json={"prompt": "x"}), 401, None)
    assert httpx.get(url + "/health").status_code == 200      # probes need no key
    assert httpx.get(url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    c = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
    assert c.models.list().data[0].id == "tiny"
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert r.usage.completion_tokens >= 1


def test_body_too_large(tiny_server):
    big = {"model": "tiny", "prompt": "x" * 100_000, "max_tokens": 1}
    err = check_error(httpx.post(tiny_server.url + "/v1/completions", json=big, headers=tiny_server.headers()),
                      413, None)
    assert "limit" in err["message"]
    ok_request(tiny_server)

    def chunks():  # no Content-Length: the limit is enforced while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i:i + 8192]

    r = httpx.post(tiny_server.url + "/v1/completions", content=chunks(),
                   headers={**tiny_server.headers(), "content-type": "application/json"})
    check_error(r, 413, None)
    ok_request(tiny_server)


def test_queue_full_gives_503_with_retry_after(tiny_server):
    """One sequence runs, one waits (the bound); the next request is refused with 503."""
    body = {"model": "tiny", "prompt": "Go", "max_tokens": 600, "ignore_eos": True, "stream": True}
    started = [threading.Event(), threading.Event()]
    stop = threading.Event()
    statuses = [None, None]

    def long_stream(i):
        with httpx.Client(timeout=60, headers=tiny_server.headers()) as h:
            with h.stream("POST", tiny_server.url + "/v1/completions", json=body) as r:
                statuses[i] = r.status_code
                started[i].set()
                for _ in r.iter_lines():
                    if stop.is_set():
                        break

    threads = [threading.Thread(target=long_stream, args=(0,), daemon=True)]
    threads[0].start()
    assert started[0].wait(30)
    deadline = time.monotonic() + 10
    while tiny_server.metrics()["blitz_num_requests_running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    threads.append(threading.Thread(target=long_stream, args=(1,), daemon=True))
    threads[1].start()
    assert started[1].wait(30)
    deadline = time.monotonic() + 10
    while tiny_server.metrics()["blitz_num_requests_waiting"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert statuses == [200, 200]
        r = httpx.post(tiny_server.url + "/v1/completions", headers=tiny_server.headers(),
                       json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        err = check_error(r, 503, None)
        assert r.headers.get("retry-after") == "1"
        assert err["code"] == "queue_full"
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        m = tiny_server.metrics()
        if m["blitz_num_requests_running"] == 0 and m["blitz_num_requests_waiting"] == 0:
            break
        time.sleep(0.1)
    assert m["blitz_kv_cache_usage_perc"] == 0
    ok_request(tiny_server)
