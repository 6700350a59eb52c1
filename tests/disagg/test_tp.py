"""Issue 37, acceptance 2: a producer of tensor_parallel_size 1 feeds a consumer of size 2 (two
CPU processes over gloo): each consumer rank lands its own KV heads of the pulled blocks, and the
answers are the single engine's. A producer of size 2 stops at start-up, naming the sizes."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from disagg_helpers import ENGINE, Proc, free_port, kv, settled, start_all

PROMPTS = ["Tensor parallel consumers re-slice the heads of the blocks they pull.",
           "A second prompt, long enough to fill more than one block of sixteen tokens for sure."]


@pytest.fixture(scope="module")
def tp_pair(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("tp-pd")
    m = ["--model", str(tiny_model), *ENGINE]
    procs = [Proc([*m, *kv("kv_producer")], d, "producer"),
             Proc([*m, "--tensor-parallel-size", "2", *kv("kv_consumer", kv_load_failure_policy="fail")], d,
                  "consumer-tp2")]
    try:
        yield start_all(procs)
    finally:
        for p in procs:
            p.stop()


def _complete(url: str, prompt: str, params=None) -> str:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    if params is not None:
        body["kv_transfer_params"] = params
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_size1_producer_feeds_size2_consumer(tp_pair):
    producer, consumer = tp_pair
    pulled = consumer.metrics().get("blitz_kv_pulls_ok_total", 0)
    for prompt in PROMPTS:
        single = _complete(producer.url, prompt)          # the producer asked plainly: one engine, one rank
        r = httpx.post(producer.url + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}})
        params = r.json()["kv_transfer_params"]
        assert params["tp_size"] == 1 and params["remote_num_tokens"] > 16
        assert _complete(consumer.url, prompt, params) == single
    assert consumer.metrics()["blitz_kv_pulls_ok_total"] == pulled + len(PROMPTS)   # (policy 'fail': no recompute)
    settled(producer, consumer)


def test_size2_producer_refused_at_start(tiny_model):
    out = subprocess.run([sys.executable, "-m", "blitzllm.cli", "serve", "--model", str(tiny_model), *ENGINE,
                          "--port", str(free_port()), "-tp", "2", *kv("kv_producer")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "kv_producer needs tensor_parallel_size 1, got 2" in out.stderr, out.stderr[-2000:]
