"""Issue 37, acceptance 1 (CPU, separate processes, SmolLM2): router + producer + consumer give
the single engine's greedy answers, streamed and not; the consumer really pulled the KV; 64
concurrent requests complete and leave both engines with nothing running and no KV held. And a
client that drops its stream through the router frees both sides."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from disagg_helpers import settled

PROMPTS = ["The three primary colors are", "Once upon a time, in a small village, there lived an old baker who"]
CHATS = [[{"role": "system", "content": "You answer in one short sentence."},
          {"role": "user", "content": "What is the capital of Japan?"}]]


def _sse_text(body: str, chat: bool) -> str:
    out = []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            for c in ev["choices"]:
                out.append((c["delta"].get("content") or "") if chat else c["text"])
    assert body.rstrip().endswith("data: [DONE]")
    return "".join(out)


def _ask(url: str, path: str, body: dict, stream: bool) -> str:
    r = httpx.post(url + path, json={**body, "stream": stream}, timeout=120)
    assert r.status_code == 200, r.text
    chat = path.endswith("chat/completions")
    if stream:
        return _sse_text(r.text, chat)
    c = r.json()["choices"][0]
    return c["message"]["content"] if chat else c["text"]


def test_same_greedy_answers_as_a_single_engine(smol, pd_router):
    producer, consumer = smol
    before_c, before_p = consumer.metrics(), producer.metrics()
    cases = [("/v1/completions", {"prompt": p}) for p in PROMPTS] + \
            [("/v1/chat/completions", {"messages": m}) for m in CHATS]
    for path, extra in cases:
        body = {"model": "smollm2", "max_tokens": 8, "temperature": 0, **extra}
        single = _ask(consumer.url, path, body, stream=False)   # no kv_transfer_params: one engine
        assert single
        for stream in (False, True):
            assert _ask(pd_router.url, path, body, stream) == single, (path, extra, stream)
    after_c = consumer.metrics()
    routed = 2 * len(cases)
    # every routed request was prefilled on the producer and its KV pulled by the consumer
    assert after_c["blitz_kv_pulls_ok_total"] - before_c.get("blitz_kv_pulls_ok_total", 0) == routed
    assert after_c.get("blitz_kv_pulls_failed_total", 0) == before_c.get("blitz_kv_pulls_failed_total", 0)
    assert after_c["blitz_kv_pulled_blocks_total"] > before_c.get("blitz_kv_pulled_blocks_total", 0)
    # the producer counts a lease completed when its engine thread frees the released blocks, which
    # may come after the last answer: read it once both servers have settled
    after_p = settled(producer, consumer)[producer.name]
    assert after_p["blitz_kv_leases_completed_total"] - before_p.get("blitz_kv_leases_completed_total", 0) == routed


def test_64_concurrent_requests_complete_and_free_everything(smol, pd_router):
    producer, consumer = smol

    async def one(client, i):
        body = {"model": "smollm2", "prompt": f"Request {i}: list three fruits:", "max_tokens": 4,
                "temperature": 0, "stream": i % 2 == 0}
        r = await client.post(pd_router.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        if i % 2 == 0:
            return _sse_text(r.text, chat=False)
        return r.json()["choices"][0]["text"]

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    answers = asyncio.run(main())
    assert len(answers) == 64 and all(isinstance(a, str) for a in answers)
    ms = settled(producer, consumer)
    assert ms["producer"]["blitz_kv_cache_usage_perc"] == 0 and ms["consumer"]["blitz_kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("n", [1, 3])
def test_client_dropping_a_stream_frees_both_sides(smol, pd_router, n):
    """Also a stream of n = 3 (three children interleaved): every child's decode stops."""
    producer, consumer = smol
    body = {"model": "smollm2", "prompt": "Write a long story about a dragon:", "max_tokens": 400,
            "ignore_eos": True, "temperature": 0, "stream": True, "n": n}
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", pd_router.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            chunks = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks += 1
                if chunks >= 3:
                    break
        # (leaving the block closes the connection mid-stream)
    assert consumer.metrics()["blitz_generation_tokens_total"] > 0
    settled(producer, consumer, timeout=20)


def test_a_truncated_prompt_is_pulled_and_answered_as_a_single_engine(smol, pd_router):
    """truncate_prompt_tokens on both hops: the consumer pulls the KV of the kept tokens (the
    producer's prompt digest matches) and answers as one engine does."""
    producer, consumer = smol
    body = {"model": "smollm2", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "truncate_prompt_tokens": 6}
    single = _ask(consumer.url, "/v1/completions", body, stream=False)
    before = consumer.metrics()
    assert _ask(pd_router.url, "/v1/completions", body, stream=False) == single
    after = consumer.metrics()
    assert after["blitz_kv_pulls_ok_total"] - before.get("blitz_kv_pulls_ok_total", 0) == 1
    assert after.get("blitz_kv_pulls_failed_total", 0) == before.get("blitz_kv_pulls_failed_total", 0)
    whole = _ask(consumer.url, "/v1/completions", {**body, "truncate_prompt_tokens": None}, stream=False)
    assert whole != single   # (the truncation changed the answer: the check above means something)
    settled(producer, consumer)


def _choices(r: httpx.Response, chat: bool, stream: bool) -> tuple:
    """(each choice's text by index, usage) of an answer, whole or streamed."""
    assert r.status_code == 200, r.text
    if not stream:
        body = r.json()
        assert [c["index"] for c in body["choices"]] == list(range(len(body["choices"])))
        return [c["message"]["content"] if chat else c["text"] for c in body["choices"]], body["usage"]
    texts, usage = {}, None
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            if ev.get("usage") is not None and not ev["choices"]:
                assert usage is None   # (one usage event)
                usage = ev["usage"]
            for c in ev["choices"]:
                piece = (c["delta"].get("content") or "") if chat else c["text"]
                texts[c["index"]] = texts.get(c["index"], "") + piece
    assert r.text.rstrip().endswith("data: [DONE]") and r.text.count("data: [DONE]") == 1
    return [texts[i] for i in sorted(texts)], usage


def test_n_completions_are_split_and_merged_as_one_engine_answers(smol, pd_router):
    """n = 3 through the router (vLLM's P/D proxy splits such a request too): three prefill and
    decode hops of one completion, each seeded as the engine seeds completion i, merged into one
    answer, whole or streamed, with the choices, the texts and the usage one engine gives; every
    child's KV pulled; nothing held after."""
    producer, consumer = smol
    cases = [("/v1/completions", {"prompt": PROMPTS[0]}, False), ("/v1/chat/completions", {"messages": CHATS[0]}, True),
             ("/v1/completions", {"prompt": PROMPTS[1]}, True)]
    before, distinct = consumer.metrics(), []
    for path, extra, stream in cases:
        chat = path.endswith("chat/completions")
        body = {"model": "smollm2", "max_tokens": 6, "temperature": 0.9, "seed": 1234, "n": 3, "stream": stream,
                **({"stream_options": {"include_usage": True}} if stream else {}), **extra}
        single = _choices(httpx.post(consumer.url + path, json=body, timeout=120), chat, stream)
        routed = _choices(httpx.post(pd_router.url + path, json=body, timeout=120), chat, stream)
        assert routed == single, (path, stream)
        distinct.append(len(set(single[0])) > 1)
    assert any(distinct)   # (the children's seeds differ: different samples)
    after = consumer.metrics()
    assert after["blitz_kv_pulls_ok_total"] - before.get("blitz_kv_pulls_ok_total", 0) == 3 * len(cases)
    bad = httpx.post(pd_router.url + "/v1/completions", json={"model": "smollm2", "prompt": "x", "n": 0}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    settled(producer, consumer)
