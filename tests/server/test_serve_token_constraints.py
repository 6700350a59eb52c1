"""vLLM's request extensions ``allowed_token_ids``, ``bad_words`` and ``truncate_prompt_tokens``
on /v1/chat/completions and /v1/completions: the answers equal ``LLM``'s with the same
SamplingParams (the float32 server and engine), the usage counts the tokens the model saw, an
echo shows them, and bad values are 400s naming their field."""
from __future__ import annotations

import httpx
import pytest

from blitzllm import SamplingParams
from tests.server.server_helpers import wait_idle

CHAT = [{"role": "user", "content": "What is the capital of Germany? Answer in one word."}]


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json={"model": "smollm2", **body}, headers=srv.headers(), timeout=120)


def ok(srv, path: str, body: dict) -> dict:
    r = post(srv, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def test_bad_words_and_allowed_token_ids_equal_the_engines(smol_f32_server, smollm2_llm):
    srv, llm = smol_f32_server, smollm2_llm
    greedy = SamplingParams(temperature=0, max_tokens=12)
    free = llm.chat(CHAT, greedy)[0].outputs[0].text
    assert "Berlin" in free
    body = {"messages": CHAT, "temperature": 0, "max_tokens": 12}
    got = ok(srv, "/v1/chat/completions", {**body, "bad_words": ["Berlin"]})["choices"][0]["message"]["content"]
    assert got == llm.chat(CHAT, greedy.clone(bad_words=["Berlin"]))[0].outputs[0].text and "Berlin" not in got
    prompt = "The capital of France is Paris. The capital of Germany is"
    ids = llm.tokenize(prompt)
    allowed = sorted(set(llm.tokenize(" a city of Germany, a country")))
    want = llm.generate(ids, greedy.clone(allowed_token_ids=allowed))[0].outputs[0]
    c = ok(srv, "/v1/completions", {"prompt": prompt, "temperature": 0, "max_tokens": 12, "allowed_token_ids": allowed,
                                    "logprobs": 0})["choices"][0]
    assert c["text"] == want.text and want.text
    assert all(t in allowed for t in want.token_ids)


def test_truncate_prompt_tokens_on_chat(smol_f32_server, smollm2_llm):
    srv = smol_f32_server
    ids = ok(srv, "/tokenize", {"messages": CHAT})["tokens"]
    k = len(ids) - 6
    r = ok(srv, "/v1/chat/completions", {"messages": CHAT, "temperature": 0, "max_tokens": 8, "truncate_prompt_tokens": k})
    assert r["usage"]["prompt_tokens"] == k
    want = smollm2_llm.generate(ids[-k:], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert r["choices"][0]["message"]["content"] == want


def test_truncate_prompt_tokens_on_completions(smol_f32_server, smollm2_llm):
    srv = smol_f32_server
    long = "The quick brown fox jumps over the lazy dog. " * 120   # past max_model_len (1024 tokens)
    ids = smollm2_llm.tokenize(long)
    assert len(ids) > 1024
    r = post(srv, "/v1/completions", {"prompt": long, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    body = {"prompt": long, "temperature": 0, "max_tokens": 6, "truncate_prompt_tokens": 50, "echo": True}
    c = ok(srv, "/v1/completions", body)
    assert c["usage"]["prompt_tokens"] == 50
    kept = smollm2_llm.tokenizer.decode(ids[-50:])
    want = smollm2_llm.generate(ids[-50:], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    assert c["choices"][0]["text"] == kept + want
    # token ids too, and -1: as many as max_model_len allows (then none are left to generate)
    c = ok(srv, "/v1/completions", {**body, "prompt": ids, "echo": False})
    assert c["choices"][0]["text"] == want and c["usage"]["prompt_tokens"] == 50
    r = post(srv, "/v1/completions", {**body, "prompt": ids, "truncate_prompt_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "allowed_token_ids", []),
    ("/v1/chat/completions", "allowed_token_ids", [1, 10 ** 9]),
    ("/v1/completions", "allowed_token_ids", ["a"]),
    ("/v1/completions", "bad_words", ["ok", "  "]),
    ("/v1/chat/completions", "bad_words", "Berlin"),
    ("/v1/chat/completions", "truncate_prompt_tokens", 0),
    ("/v1/completions", "truncate_prompt_tokens", -3),
    ("/v1/completions", "truncate_prompt_tokens", 2000),
])
def test_bad_values_are_400s_naming_the_field(smol_f32_server, path, field, value):
    body = {"messages": CHAT} if "chat" in path else {"prompt": "Hello"}
    r = post(smol_f32_server, path, {**body, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == field, r.json()   # (an item: field.index)
    m = wait_idle(smol_f32_server, timeout=5.0)
    assert m["blitz_kv_cache_blocks_free"] == m["blitz_kv_cache_blocks_total"]


def test_allowed_token_ids_outside_a_grammars_next_tokens_leave_the_grammar_to_win(smol_f32_server):
    """structured_outputs regex + allowed_token_ids: once the grammar can only end (EOS, not
    allowed), it ends, rather than <|endoftext|> (id 0, allowed by neither) until max_tokens."""
    srv = smol_f32_server
    digits = ok(srv, "/tokenize", {"prompt": "1 2 3", "add_special_tokens": False})["tokens"]
    body = {"prompt": "Number:", "temperature": 0, "max_tokens": 8, "structured_outputs": {"regex": "[0-9]{3}"},
            "allowed_token_ids": digits, "skip_special_tokens": False}
    c = ok(srv, "/v1/completions", body)["choices"][0]
    assert c["text"].isdigit() and len(c["text"]) == 3 and c["finish_reason"] == "stop", c
