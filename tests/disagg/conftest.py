"""Fixtures of the disaggregation tests: one SmolLM2 producer and one consumer (shared by the
whole folder; the consumer, asked without kv_transfer_params, is also the single-engine
reference), the routers in front of them, and a tiny random Llama for the fault tests."""
from __future__ import annotations

import importlib.util

import pytest

from disagg_helpers import ENGINE, Proc, kv, start_all, tiny_llama

if importlib.util.find_spec("nixl") is None:
    pytest.skip("needs nixl (pip install nixl)", allow_module_level=True)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """(producer, consumer) serving SmolLM2, per test module: their NIXL agents' progress threads poll
    while idle, so they must not outlive the modules that use them."""
    d = tmp_path_factory.mktemp("smol-pd")
    procs = [Proc(["--model", "smollm2", *ENGINE, *kv("kv_producer", kv_lease_s=20)], d, "producer"),
             Proc(["--model", "smollm2", *ENGINE, *kv("kv_consumer")], d, "consumer")]
    try:
        yield start_all(procs)
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def pd_router(smol, tmp_path_factory):
    p, c = smol
    r = Proc(["--prefill", p.url, "--decode", c.url, "--health-interval", "0.5"],
             tmp_path_factory.mktemp("router"), "router", cmd="router")
    try:
        yield r.wait_ready(60)
    finally:
        r.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
