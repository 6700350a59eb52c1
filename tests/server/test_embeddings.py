"""POST /v1/embeddings on a real ``blitz serve`` (SmolLM2, fp32 on the CPU as the offline engine
runs it), through the official ``openai`` client and raw HTTP: the vectors are the offline
``LLM.embed``'s (the same engine, other batches: float32 rounding, 1e-4), as floats and base64,
for text and token-id inputs, with usage; and the errors."""
from __future__ import annotations

import base64
import struct

import httpx
import pytest

from tests.server.server_helpers import check_error, client, rejected, tokens_of, wait_idle

MODEL = "smollm2"
TOL = 1e-4


@pytest.fixture(scope="module")
def offline(smollm2_llm):
    import torch
    if torch.cuda.is_available():
        pytest.skip("the server runs bf16 on CUDA; this compares with the CPU's fp32 engine")
    return smollm2_llm


def same(a, b) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < TOL


def post(srv, body: dict) -> httpx.Response:
    return httpx.post(srv.url + "/v1/embeddings", json=body, headers=srv.headers(), timeout=120)


def test_text_inputs_through_the_openai_client(smol_server, offline):
    texts = ["The capital of France is Paris.", "Hello", "A longer sentence about the sea and the sky " * 5]
    m = smol_server.metrics()
    before, ttft = m["blitz_prompt_tokens_total"], m["blitz_time_to_first_token_seconds_count"]
    # (the SDK asks for base64 when no encoding_format is given, and decodes it)
    for fmt in ("float", None):
        kw = {} if fmt is None else {"encoding_format": fmt}
        r = client(smol_server).embeddings.create(model=MODEL, input=texts, **kw)
        assert r.object == "list" and r.model == MODEL and len(r.data) == 3
        for i, (d, want) in enumerate(zip(r.data, offline.embed(texts))):
            assert d.index == i and d.object == "embedding"
            assert same(d.embedding, want.outputs.embedding)
        n = sum(tokens_of(smol_server, prompt=t) for t in texts)
        assert r.usage.prompt_tokens == r.usage.total_tokens == n
    m = wait_idle(smol_server)
    assert m["blitz_kv_cache_usage_perc"] == 0
    assert m["blitz_prompt_tokens_total"] - before == 2 * n
    assert m["blitz_time_to_first_token_seconds_count"] == ttft   # (no tokens: no time to the first)


def test_raw_float_and_base64_and_token_ids(smol_server, offline):
    ids = [[1, 504, 3458, 314, 4649], [28, 29, 30]]
    want = [o.outputs.embedding for o in offline.embed(ids)]
    f = post(smol_server, {"input": ids, "encoding_format": "float"})
    b = post(smol_server, {"input": ids, "encoding_format": "base64", "model": MODEL, "user": "u1"})
    assert f.status_code == b.status_code == 200, (f.text, b.text)
    body = f.json()
    assert body["id"].startswith("embd-") and isinstance(body["created"], int)
    assert body["usage"] == {"prompt_tokens": 8, "total_tokens": 8}
    for fd, bd, w in zip(body["data"], b.json()["data"], want):
        raw = base64.b64decode(bd["embedding"])
        decoded = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        assert same(fd["embedding"], w) and same(decoded, w) and len(decoded) == 576
    one = post(smol_server, {"input": ids[0]}).json()
    assert len(one["data"]) == 1 and same(one["data"][0]["embedding"], want[0])


def test_vllm_fields(smol_server, offline):
    from blitzllm import PoolingParams
    text = "one two three four five six seven eight nine ten"
    ids = offline.tokenize(text)
    r = post(smol_server, {"input": text, "normalize": False, "truncate_prompt_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 4
    want = offline.embed([ids[-4:]], PoolingParams(normalize=False))[0].outputs.embedding
    assert same(r.json()["data"][0]["embedding"], want)
    r = post(smol_server, {"input": text, "add_special_tokens": False})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(offline.tokenizer.encode(
        text, add_special_tokens=False))


@pytest.mark.parametrize("body, status, param", [
    ({"input": "Hi", "model": "gpt-4"}, 404, "model"),
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": ["a"] * 2049}, 400, "input"),
    ({"input": [[10 ** 9]]}, 400, "input"),
    ({"input": "Hi", "dimensions": 8}, 400, "dimensions"),
    ({"input": "Hi", "dimensions": 0}, 400, "dimensions"),
    ({"input": "Hi", "encoding_format": "hex"}, 400, "encoding_format"),
    ({"input": "Hi", "normalize": "yes"}, 400, "normalize"),
    ({"input": "Hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"input": "Hi", "truncate_prompt_tokens": 5000}, 400, "truncate_prompt_tokens"),
    ({}, 400, "input"),
])
def test_errors(smol_server, body, status, param):
    before = rejected(smol_server)
    check_error(post(smol_server, body), status, param)
    assert rejected(smol_server) == before + 1


def test_too_long_is_a_400_and_a_full_context_is_not(smol_server):
    n = 1024   # (the server's --max-model-len)
    err = check_error(post(smol_server, {"input": [[5] * (n + 1)]}), 400, "input")
    assert err["code"] == "context_length_exceeded"
    err = check_error(post(smol_server, {"input": ["Hi", "word " * 1100]}), 400, "input.1")
    assert err["code"] == "context_length_exceeded"
    r = post(smol_server, {"input": [[5] * n], "encoding_format": "base64"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == n
    assert wait_idle(smol_server)["blitz_kv_cache_usage_perc"] == 0


def test_a_client_that_leaves_has_its_inputs_aborted(smol_server):
    """200 inputs of ~700 tokens (many minutes of CPU work): the client gives up after a second;
    every input's request is aborted and its blocks freed once the step in flight ends (a CPU
    step of 2048 prompt tokens may take ~15 s on a busy machine)."""
    body = {"input": [f"{i} " + "words about the weather and the sea " * 100 for i in range(200)]}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(smol_server.url + "/v1/embeddings", json=body, headers=smol_server.headers(), timeout=1.0)
    m = wait_idle(smol_server, timeout=90)
    assert m["blitz_num_requests_running"] == 0 and m["blitz_num_requests_waiting"] == 0
    assert m["blitz_kv_cache_usage_perc"] == 0
