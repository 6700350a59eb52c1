"""OpenAI's ``truncation`` on /v1/responses: ``auto`` drops the conversation's oldest turns (the
instructions stay) until the prompt leaves room for ``max_output_tokens``, as few as that takes;
the answer is the one the kept part gets alone. ``disabled`` (the default) answers a prompt too
long with a 400, as does ``auto`` when even the last turn does not fit."""
from __future__ import annotations

import httpx

from tests.server.server_helpers import check_error, wait_idle

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def _conversation(turns: int) -> list:
    items = []
    for t in range(turns):
        text = " ".join(WORDS[(t + i) % len(WORDS)] for i in range(50))
        items.append({"role": "user", "content": f"turn {t}: {text}"})
        items.append({"role": "assistant", "content": f"noted {t}: {text[:120]}"})
    return items + [{"role": "user", "content": "Which turn came last?"}]


def post(srv, body: dict) -> httpx.Response:
    return httpx.post(srv.url + "/v1/responses", headers=srv.headers(), timeout=120,
                      json={"model": "tiny", "instructions": "Be brief.", "temperature": 0, "store": False, **body})


def test_auto_drops_the_fewest_oldest_turns_that_make_it_fit(tiny_server):
    srv, max_out = tiny_server, 16
    items = _conversation(12)
    check_error(post(srv, {"input": items, "max_output_tokens": max_out}), 400, "input")
    r = post(srv, {"input": items, "max_output_tokens": max_out, "truncation": "auto"})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["truncation"] == "auto"

    def tokens(part: list) -> int:
        t = httpx.post(srv.url + "/tokenize", headers=srv.headers(), timeout=60,
                       json={"model": "tiny", "messages": [{"role": "system", "content": "Be brief."}, *part],
                             "add_generation_prompt": True})
        assert t.status_code == 200, t.text
        return t.json()["count"]

    room = 1024 - max_out
    starts = [i for i, m in enumerate(items) if m["role"] == "user"]
    fits = [i for i in starts if tokens(items[i:]) <= room]
    assert fits and fits[0] > 0       # something had to go, and the last turns fit
    kept = items[fits[0]:]
    assert got["usage"]["input_tokens"] == tokens(kept)
    alone = post(srv, {"input": kept, "max_output_tokens": max_out})
    assert alone.status_code == 200, alone.text
    assert got["output"][0]["content"][0]["text"] == alone.json()["output"][0]["content"][0]["text"]
    # the last turn alone too long: nothing to drop makes it fit
    huge = [{"role": "user", "content": " ".join(WORDS * 80)}]
    check_error(post(srv, {"input": huge, "max_output_tokens": max_out, "truncation": "auto"}), 400, "input")
    wait_idle(srv)
