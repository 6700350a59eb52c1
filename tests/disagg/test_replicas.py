"""Issue 37, acceptance 4: ``blitz router --backend``: 64 requests spread over two replicas; with
``--prefix-aware`` every turn of a multi-turn conversation lands on one replica, whose
prefix cache then serves the earlier turns (its /metrics)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from disagg_helpers import Proc, settled

SYSTEM = ("You are a patient assistant for a hiking club. You answer questions about trails, weather, "
          "gear and safety in the mountains. Keep every answer short and friendly, and never invent "
          "trail names that you were not told about.")


@pytest.fixture(scope="module")
def replicas(smol, tmp_path_factory):
    """The two SmolLM2 servers as plain replicas (asked without kv_transfer_params they are)."""
    d = tmp_path_factory.mktemp("replicas")
    urls = [s.url for s in smol]
    plain = Proc(["--backend", *urls], d, "router", cmd="router")
    aware = Proc(["--backend", *urls, "--prefix-aware"], d, "router-prefix", cmd="router")
    try:
        yield plain.wait_ready(60), aware.wait_ready(60)
    finally:
        plain.stop()
        aware.stop()


def _per_backend(router) -> dict:
    out = {}
    for (name, labels), v in router.labelled_metrics().items():
        lab = dict(labels)
        if name == "blitz_router_requests_total" and lab.get("status") == "200":
            out[lab["backend"]] = out.get(lab["backend"], 0) + v
    return out


def test_64_requests_spread_over_two_replicas(smol, replicas):
    router = replicas[0]

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            rs = await asyncio.gather(*(client.post(router.url + "/v1/completions", json={
                "prompt": f"Fact {i} about the moon:", "max_tokens": 3, "temperature": 0}) for i in range(64)))
        return rs

    rs = asyncio.run(main())
    assert all(r.status_code == 200 for r in rs)
    counts = _per_backend(router)
    assert sum(counts.values()) == 64 and len(counts) == 2 and min(counts.values()) >= 16, counts
    settled(*smol)


def test_prefix_aware_keeps_a_conversation_on_one_replica(smol, replicas):
    router = replicas[1]
    hits = {s.url: s.metrics()["blitz_prefix_cache_hit_tokens_total"] for s in smol}
    messages = [{"role": "system", "content": SYSTEM}]
    for q in ("Which trail is best for beginners?", "What should I pack?", "Is it safe in the rain?"):
        messages.append({"role": "user", "content": q})
        r = httpx.post(router.url + "/v1/chat/completions", timeout=120,
                       json={"messages": messages, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    counts = _per_backend(router)
    assert list(counts.values()) == [3], counts           # all three turns on one replica
    (url,) = counts
    chosen = next(s for s in smol if s.url == url)
    # turns 2 and 3 found the system prompt and the earlier turns in that replica's prefix cache
    assert chosen.metrics()["blitz_prefix_cache_hit_tokens_total"] - hits[url] >= 2 * 48
    settled(*smol)
