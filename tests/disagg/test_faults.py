"""Issue 37 on a tiny random Llama. Acceptance 2: a producer of tensor_parallel_size 1 feeds a
consumer of size 2 (two CPU processes over gloo; each rank lands its own KV heads) with the single
engine's answers, and a producer of size 2 stops at start-up naming the sizes. Acceptance 3 (CPU
faults): a producer killed after answering but before the pull (recompute: the same answer;
'fail': a 503 with an OpenAI error body); an unclaimed lease frees its blocks after kv_lease_s;
the router answers 503 while no backend is up and recovers when one returns. (A client dropping
a stream: test_pd.py.)"""
from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from disagg_helpers import ENGINE, Proc, free_port, kv, settled, start_all

LEASE_S = 4.0
TP_PROMPTS = [
"Tensor parallel consumers re-slice the heads of the blocks they pull from a producer that "
           "runs on a single rank, so that every rank keeps its own share of the key and value heads.",
           "A second prompt, long enough to fill more than one block of sixteen tokens for sure, and "
           "then a few words more to end in the middle of a block."]


@pytest.fixture(scope="module")
def tiny_pd(tiny_model, tmp_path_factory):
    """A producer (4 s leases) and two consumers, one per load-failure policy; the failing one
    (which never recomputes) has tensor_parallel_size 2."""
    d = tmp_path_factory.mktemp("tiny-pd")
    m = ["--model", str(tiny_model), *ENGINE]
    procs = [Proc([*m, *kv("kv_producer", kv_lease_s=LEASE_S)], d, "producer"),
             Proc([*m, *kv("kv_consumer")], d, "consumer"),
             Proc([*m, "--tensor-parallel-size", "2", *kv("kv_consumer", kv_load_failure_policy="fail")], d,
                  "failing")]
    try:
        yield start_all(procs)
    finally:
        for p in procs:
            p.stop()


def _prefill(producer, prompt: str) -> dict:
    r = httpx.post(producer.url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["remote_num_tokens"] > 0 and params["remote_block_ids"]
    return params


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _decode(server, prompt: str, params=None) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    if params is not None:
        body["kv_transfer_params"] = params
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def test_unclaimed_lease_frees_its_blocks(tiny_pd):
    producer = tiny_pd[0]
    settled(producer)
    t0 = time.monotonic()
    _prefill(producer, "A lease that nobody claims " * 4)
    m = producer.metrics()
    assert m["blitz_kv_leases_held"] == 1 and m["blitz_kv_cache_usage_perc"] > 0
    ms = settled(producer, timeout=LEASE_S + 10)
    assert time.monotonic() - t0 >= LEASE_S
    assert ms["producer"]["blitz_kv_leases_expired_total"] >= 1


def test_size1_producer_feeds_size2_consumer(tiny_pd):
    producer, consumer = tiny_pd[0], tiny_pd[2]   # (the consumer of size 2 never recomputes: policy 'fail')
    pulled = consumer.metrics().get("blitz_kv_pulls_ok_total", 0)
    for prompt in TP_PROMPTS:
        single = _text(_decode(producer, prompt))   # the producer asked plainly: one engine of one rank
        params = _prefill(producer, prompt)
        assert params["tp_size"] == 1 and params["remote_num_tokens"] > 16
        assert _text(_decode(consumer, prompt, params)) == single
    assert consumer.metrics()["blitz_kv_pulls_ok_total"] == pulled + len(TP_PROMPTS)
    settled(producer, consumer)


def test_producer_killed_before_the_pull(tiny_pd):
    producer, consumer, failing = tiny_pd
    prompt = "The producer dies before the consumer reads this prompt's blocks."
    want = _text(_decode(consumer, prompt))
    # first a good pull on each consumer (so both know the producer's NIXL agent already)
    pulled = {c.name: c.metrics().get("blitz_kv_pulls_ok_total", 0) for c in (consumer, failing)}
    for c in (consumer, failing):
        assert _text(_decode(c, prompt, _prefill(producer, prompt))) == want
        assert c.metrics()["blitz_kv_pulls_ok_total"] == pulled[c.name] + 1
    p1, p2 = _prefill(producer, prompt), _prefill(producer, prompt)
    producer.kill()
    before = consumer.metrics()
    assert _text(_decode(consumer, prompt, p1)) == want     # policy recompute: the same answer
    assert consumer.metrics()["blitz_kv_pulls_failed_total"] == before.get("blitz_kv_pulls_failed_total", 0) + 1
    r = _decode(failing, prompt, p2)             # policy fail: 503, OpenAI's error body
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "kv_load_failed"
    assert "producer" in err["message"]
    settled(consumer, failing)


def test_router_503_without_backend_then_recovers(tiny_pd, tiny_model, tmp_path_factory):
    consumer = tiny_pd[1]
    d = tmp_path_factory.mktemp("recover")
    port = free_port()
    router = Proc(["--prefill", f"http://127.0.0.1:{port}", "--decode", consumer.url, "--health-interval", "0.3"],
                  d, "router", cmd="router")
    producer = None
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                r = httpx.get(router.url + "/health", timeout=5)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, router.log()
                time.sleep(0.2)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_backend"
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        producer = Proc(["--model", str(tiny_model), *ENGINE, *kv("kv_producer")], d, "producer", port=port)
        producer.wait_ready()
        router.wait_ready(10)                     # the health poll found it
        prompt = "Back again: the producer returned."
        r = httpx.post(router.url + "/v1/completions", timeout=60,
                       json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert _text(r) == _text(_decode(consumer, prompt))
        settled(producer, consumer)
    finally:
        router.stop()
        if producer is not None:
            producer.stop()


def test_size2_producer_refused_at_start(tiny_model):
    out = subprocess.run([sys.executable, "-m", "blitzllm.cli", "serve", "--model", str(tiny_model), *ENGINE,
                          "--port", str(free_port()), "-tp", "2", *kv("kv_producer")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "kv_producer needs tensor_parallel_size 1, got 2" in out.stderr, out.stderr[-2000:]
