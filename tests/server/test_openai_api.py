"""The OpenAI surface of a real ``blitz serve`` (default SmolLM2 model), driven by the official
``openai`` client, sync and async."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.server.server_helpers import client, tokens_of, wait_idle

MODEL = "smollm2"
MSG = [{"role": "user", "content": "What is the capital of France?"}]


def aclient(srv) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_health_was_503_while_loading_then_200(smol_server):
    assert smol_server.health_codes[0] == 503
    assert smol_server.health_codes[-1] == 200
    assert httpx.get(smol_server.url + "/health").status_code == 200
    r = smol_server.loading_response      # a request while loading: 503, retry later
    assert r is not None and r.status_code == 503 and "retry-after" in r.headers
    assert r.json()["error"]["code"] == "model_loading"


def test_models(smol_server):
    c = client(smol_server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert c.models.retrieve(MODEL).id == MODEL


@pytest.fixture(scope="module")
def offline(request):
    """The offline engine the server runs (its defaults: fp32 on a CPU), for the greedy answers
    the server's must equal."""
    import torch
    if not torch.cuda.is_available():
        return request.getfixturevalue("smollm2_llm")  # (LLM("smollm2", dtype="float32", device="cpu"))
    from blitzllm import LLM
    return LLM("smollm2")


def test_chat_completion_and_usage(smol_server, offline):
    from blitzllm import SamplingParams
    r = client(smol_server).chat.completions.create(model=MODEL, messages=MSG, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    ch = r.choices[0]
    assert ch.index == 0 and ch.message.role == "assistant"
    want = offline.chat(MSG, SamplingParams(temperature=0, max_tokens=12))[0]  # the same greedy answer offline
    assert ch.message.content == want.text and "Paris" in want.text
    assert ch.finish_reason == want.finish_reason and r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.prompt_tokens == tokens_of(smol_server, messages=MSG)
    assert 1 <= r.usage.completion_tokens <= 12
    if ch.finish_reason == "length":
        assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_usage_and_echo(smol_server, offline):
    from blitzllm import SamplingParams
    c = client(smol_server)
    prompt = "The capital of France is"
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion"
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert r.choices[0].text == want.text and len(want.token_ids) == 8
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == tokens_of(smol_server, prompt=prompt)
    assert r.usage.completion_tokens == 8
    e = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True,
                             extra_body={"ignore_eos": True})
    assert e.choices[0].text == prompt + r.choices[0].text


def test_completion_prompt_forms(smol_server):
    """A list of strings and token id lists: one choice per prompt, usage summed."""
    c = client(smol_server)
    ids = httpx.post(smol_server.url + "/tokenize", json={"prompt": "Paris is"}).json()["tokens"]
    r = c.completions.create(model=MODEL, prompt=["Paris is", "Rome is"], max_tokens=3, temperature=0,
                             extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 6
    t = c.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert t.choices[0].text == r.choices[0].text  # same tokens, same greedy continuation
    tt = c.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    assert [ch.text for ch in tt.choices] == [t.choices[0].text] * 2


def test_chat_stream_equals_non_stream(smol_server):
    c = client(smol_server)
    kw = dict(model=MODEL, messages=MSG, max_tokens=16, temperature=0)
    full = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert reasons == [full.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == \
        (full.usage.prompt_tokens, full.usage.completion_tokens)


def test_chat_stream_continuous_usage_on_every_chunk(smol_server):
    """stream_options continuous_usage_stats: every chunk has usage, the role chunk too (0 tokens
    so far), its completion_tokens never falling, its prompt_tokens the request's."""
    c = client(smol_server)
    kw = dict(model=MODEL, messages=MSG, max_tokens=8, temperature=0)
    full = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].usage.completion_tokens == 0
    assert all(ch.usage is not None and ch.usage.prompt_tokens == full.usage.prompt_tokens for ch in chunks)
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert counts == sorted(counts) and counts[-1] == full.usage.completion_tokens


def test_completion_stream_equals_non_stream_async(smol_server):
    async def go():
        c = aclient(smol_server)
        kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0)
        full = await c.completions.create(**kw)
        parts, usage = [], None
        async for ch in await c.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            if ch.choices:
                parts.append(ch.choices[0].text)
            if ch.usage:
                usage = ch.usage
        await c.close()
        return full, "".join(parts), usage

    full, text, usage = asyncio.run(go())
    assert text == full.choices[0].text
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_logprobs_shape(smol_server):
    r = client(smol_server).chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, temperature=0,
                                                    logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0 and t.bytes == list(t.token.encode())
        assert len(t.top_logprobs) == 3
        lps = [x.logprob for x in t.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert t.top_logprobs[0].token == t.token and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5  # greedy
    if r.choices[0].finish_reason == "length":
        assert "".join(t.token for t in content) == r.choices[0].message.content


def test_completion_logprobs_shape(smol_server):
    r = client(smol_server).completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=5, temperature=0,
                                               logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(1 <= len(d) <= 2 for d in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)


def test_completion_top_logprobs_hold_the_chosen_token(smol_server):
    """A chosen token outside the top k (forced here by logit_bias; logprobs are of the raw
    distribution) is still in its step's top_logprobs, as the k + 1-th entry (OpenAI's legacy
    API and vLLM; before: only the top k)."""
    ids = httpx.post(smol_server.url + "/tokenize", json={"prompt": " banana"}, timeout=60).json()["tokens"]
    assert len(ids) == 1
    r = httpx.post(smol_server.url + "/v1/completions", json={
        "prompt": "1, 2, 3,", "max_tokens": 2, "temperature": 0, "logprobs": 1,
        "logit_bias": {str(ids[0]): 100}}, timeout=60).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == [" banana", " banana"], r
    for tok, tlp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) == 2 and top[tok] == tlp and max(top.values()) > tlp


def test_n2(smol_server):
    c = client(smol_server)
    r = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5, temperature=1.0, seed=7, n=2,
                                  logprobs=True, top_logprobs=0)
    assert [ch.index for ch in r.choices] == [0, 1]
    assert r.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in r.choices)
    again = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5, temperature=1.0, seed=7, n=2)
    assert [ch.message.content for ch in again.choices] == [ch.message.content for ch in r.choices]  # seeded
    seen = {}
    for ch in c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5, temperature=1.0, n=2, stream=True):
        for x in ch.choices:
            if x.finish_reason:
                seen[x.index] = seen.get(x.index, 0) + 1
    assert seen == {0: 1, 1: 1}


def test_stop_strings(smol_server):
    c = client(smol_server)
    kw = dict(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    base = c.completions.create(**kw).choices[0].text
    words = base.split()
    assert len(words) >= 3, base
    stop = words[len(words) // 2]
    expected = base[:base.index(stop)]
    r = c.completions.create(**kw, stop=[stop, "never-appears-xyz"])
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(**kw, stop=stop, stream=True) if ch.choices)
    assert streamed == expected


def test_32_concurrent_streams(smol_server):
    async def one(c, i):
        text, reasons = [], []
        stream = await c.completions.create(model=MODEL, prompt=f"Story number {i}:", max_tokens=4,
                                            temperature=0.7, seed=i, stream=True, extra_body={"ignore_eos": True})
        async for ch in stream:
            for x in ch.choices:
                text.append(x.text)
                if x.finish_reason:
                    reasons.append(x.finish_reason)
        return "".join(text), reasons

    async def go():
        c = aclient(smol_server)
        out = await asyncio.gather(*(one(c, i) for i in range(32)))
        await c.close()
        return out

    results = asyncio.run(go())
    assert len(results) == 32
    for text, reasons in results:
        assert reasons == ["length"] and text
    m = wait_idle(smol_server)
    assert m["blitz_num_requests_running"] == 0


def test_tokenize_detokenize(smol_server):
    r = httpx.post(smol_server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 1024
    d = httpx.post(smol_server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["prompt"] == "Hello world"


def test_metrics_names(smol_server):
    text = httpx.get(smol_server.url + "/metrics").text
    for name in ("blitz_time_to_first_token_seconds_bucket", "blitz_inter_token_latency_seconds_bucket",
                 "blitz_e2e_request_latency_seconds_bucket", "blitz_num_requests_running",
                 "blitz_num_requests_waiting", "blitz_kv_cache_usage_perc", "blitz_prefix_cache_hit_tokens_total",
                 "blitz_num_preemptions_total", "blitz_prompt_tokens_total", "blitz_generation_tokens_total"):
        assert name in text, name
    m = smol_server.metrics()
    assert m["blitz_time_to_first_token_seconds_count"] > 0
    assert m["blitz_generation_tokens_total"] > 0 and m["blitz_prompt_tokens_total"] > 0
    assert m["blitz_prefix_cache_hit_tokens_total"] > 0   # the chat system prompt is shared
    from prometheus_client.parser import text_string_to_metric_families
    info = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "blitz_cache_config_info"]
    assert len(info) == 1 and info[0].value == 1
    assert {k: v for k, v in info[0].labels.items() if k != "model_name"} == {
        "block_size": "16", "cache_dtype": "auto", "num_gpu_blocks": str(int(m["blitz_kv_cache_blocks_total"])),
        "enable_prefix_caching": "true"}


def test_disconnect_mid_stream_frees_blocks(smol_server):
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", smol_server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            # keep the line iterator alive: closing it (a `break` out of a for loop drops it)
            # closes the connection, which is the disconnect this test makes only below
            it = r.iter_lines()
            lines = []
            while len(lines) < 3:
                line = next(it)
                if line.startswith("data:"):
                    lines.append(line)
            held = smol_server.metrics()
            seen = {k: v for k, v in held.items() if k.startswith(("blitz_kv", "blitz_num_req", "blitz_gen"))}
            assert held["blitz_kv_cache_usage_perc"] > 0 and held["blitz_num_requests_running"] == 1, (seen, lines)
            del it
    t0 = time.monotonic()
    m = wait_idle(smol_server, timeout=2.0)
    assert m["blitz_kv_cache_usage_perc"] == 0, m
    assert m["blitz_num_requests_running"] == 0
    assert m["blitz_kv_cache_blocks_free"] == m["blitz_kv_cache_blocks_total"]
    assert time.monotonic() - t0 <= 2.0
    r = client(smol_server).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert r.choices[0].text is not None


def test_load_64_concurrent_requests(smol_server):
    async def one(c, i):
        if i % 2:
            r = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Say {i}."}],
                                                max_tokens=4, temperature=0.8, seed=i, extra_body={"ignore_eos": True})
            return r.choices[0].finish_reason, r.usage.completion_tokens
        r = await c.completions.create(model=MODEL, prompt=f"Number {i} is", max_tokens=4, temperature=0.8,
                                       seed=i, extra_body={"ignore_eos": True})
        return r.choices[0].finish_reason, r.usage.completion_tokens

    async def go():
        c = aclient(smol_server)
        out = await asyncio.gather(*(one(c, i) for i in range(64)), return_exceptions=True)
        await c.close()
        return out

    results = asyncio.run(go())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert results == [("length", 4)] * 64
    m = wait_idle(smol_server)
    assert m["blitz_kv_cache_usage_perc"] == 0
    assert m["blitz_kv_cache_blocks_free"] == m["blitz_kv_cache_blocks_total"]
    assert m["blitz_num_requests_running"] == 0 and m["blitz_num_requests_waiting"] == 0


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/metrics", "/version"])
def test_get_endpoints_no_key_needed_without_api_key(smol_server, path):
    assert httpx.get(smol_server.url + path).status_code == 200


def test_version_is_the_installed_packages(smol_server):
    from importlib.metadata import version
    assert httpx.get(smol_server.url + "/version").json() == {"version": version("blitzllm")}


def test_reset_prefix_cache_forgets_the_cached_prompts(smol_server):
    srv = smol_server
    prompt = {"model": MODEL, "prompt": "A long shared prefix. " * 12, "max_tokens": 2}

    def hits_of_one_completion() -> float:
        before = wait_idle(srv)["blitz_prefix_cache_hit_tokens_total"]
        assert httpx.post(srv.url + "/v1/completions", json=prompt, timeout=120).status_code == 200
        return wait_idle(srv)["blitz_prefix_cache_hit_tokens_total"] - before

    hits_of_one_completion()
    assert hits_of_one_completion() > 0       # its full blocks are cached
    r = httpx.post(srv.url + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.json() == {"reset": True}   # (nothing runs: it is done)
    assert hits_of_one_completion() == 0
