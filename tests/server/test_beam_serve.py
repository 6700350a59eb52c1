"""vLLM's ``use_beam_search`` on /v1/completions (and chat): the beams equal ``LLM.beam_search``'s
with the same settings (the float32 server and engine), best first, ``n`` wide; the fields a
beam step cannot honour are 400s naming them; nothing is left running or holding blocks."""
from __future__ import annotations

import httpx
import pytest

from blitzllm import BeamSearchParams
from tests.server.server_helpers import check_error, wait_idle

PROMPT = "The three most common pets are"


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json={"model": "smollm2", **body}, headers=srv.headers(), timeout=300)


def test_completion_beams_equal_the_engines(smol_f32_server, smollm2_llm):
    srv, llm = smol_f32_server, smollm2_llm
    want = llm.beam_search(PROMPT, BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5))[0].sequences
    r = post(srv, "/v1/completions", {"prompt": [PROMPT, "Hello"], "n": 3, "max_tokens": 6, "use_beam_search": True,
                                      "length_penalty": 0.5, "logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    first = [c for c in body["choices"] if c["index"] < 3]
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["text"] for c in first] == [b.text for b in want]
    assert [c["finish_reason"] for c in first] == [b.finish_reason for b in want]
    n_prompt = len(llm.tokenize(PROMPT))
    for c, b in zip(first, want):
        assert len(c["logprobs"]["tokens"]) == len(b.tokens) - n_prompt
        assert c["logprobs"]["token_logprobs"] == pytest.approx([b.logprobs[i][t] for i, t in
                                                                 enumerate(b.tokens[n_prompt:])], abs=1e-4)
    assert body["usage"]["prompt_tokens"] == n_prompt + len(llm.tokenize("Hello"))
    wait_idle(srv)


def test_chat_beams_equal_the_engines(smol_f32_server, smollm2_llm):
    srv, llm = smol_f32_server, smollm2_llm
    msgs = [{"role": "user", "content": "Name a color."}]
    ids = httpx.post(srv.url + "/tokenize", json={"messages": msgs}, timeout=60).json()["tokens"]
    want = llm.beam_search([ids], BeamSearchParams(beam_width=2, max_tokens=5))[0].sequences
    r = post(srv, "/v1/chat/completions", {"messages": msgs, "n": 2, "max_tokens": 5, "use_beam_search": True})
    assert r.status_code == 200, r.text
    got = r.json()["choices"]
    assert [c["message"]["content"] for c in got] == [b.text for b in want]
    assert [c["finish_reason"] for c in got] == [b.finish_reason for b in want]
    wait_idle(srv)


@pytest.mark.parametrize("extra,param", [
    ({"stream": True}, "stream"), ({"n": 11}, "n"), ({"stop": ["x"]}, "stop"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"echo": True, "logprobs": 1}, "echo"), ({"max_tokens": 0, "echo": True}, "max_tokens"),
])
def test_what_beam_search_refuses(smol_f32_server, extra, param):
    r = post(smol_f32_server, "/v1/completions", {"prompt": PROMPT, "n": 2, "max_tokens": 3, "use_beam_search": True,
                                                  **extra})
    check_error(r, 400, param)
    m = wait_idle(smol_f32_server)
    assert m["blitz_num_requests_running"] == 0 and m["blitz_kv_cache_usage_perc"] == 0
