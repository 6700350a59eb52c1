"""The router's choices without servers: prefix keys, the pick of a backend (longest known
prefix, else fewest in flight, never a down one), the text a conversation's key is made of, and
the command line's errors."""
from __future__ import annotations

import argparse

import pytest

from blitzllm.cli.router import add_router_args, config_from_args
from blitzllm.router.app import prompt_text
from blitzllm.router.backends import Pool, prefix_keys


def test_prefix_keys_are_chained():
    a, b = prefix_keys("x" * 100), prefix_keys("x" * 64 + "y" * 36)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert prefix_keys("z" * 130)[:2] != a[:2]


def test_pick_longest_prefix_then_least_outstanding():
    pool = Pool(["http://a", "http://b"], "replica")
    a, b = pool.backends
    assert pool.pick() is None          # nothing is up yet
    a.up = b.up = True
    a.outstanding = 1
    assert pool.pick() is b             # fewest in flight
    system = "system: you are a brief assistant who answers every question in one line\n"
    a.remember(prefix_keys(system + "user: hello"))
    turn2 = prefix_keys(system + "user: hello\nassistant: hi\nuser: and then?")
    assert pool.pick(turn2) is a        # the replica that saw the conversation, though busier
    a.up = False
    assert pool.pick(turn2) is b        # never a down one


def test_prompt_text_keeps_turn_order():
    t1 = prompt_text({"messages": [{"role": "user", "content": "hi"}]})
    t2 = prompt_text({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    assert t2.startswith(t1) and prompt_text({"prompt": "abc"}) == "abc"


@pytest.mark.parametrize("argv, word", [
    (["--prefill", "http://a"], "go together"),
    (["--backend", "http://a", "--prefill", "http://b", "--decode", "http://c"], "not both"),
    ([], "give --prefill"),
    (["--prefill", "http://a", "--decode", "http://b", "--prefix-aware"], "goes with --backend"),
    (["--backend", "a:8000"], "http"),
    (["--backend", "http://"], "HOST"),
    (["--backend", "http://a", "--health-interval", "nan"], "finite"),
    (["--backend", "http://a", "--request-timeout", "inf"], "finite"),
])
def test_command_line_errors(argv, word):
    p = argparse.ArgumentParser()
    add_router_args(p)
    with pytest.raises(ValueError, match=word):
        config_from_args(p.parse_args(argv))


@pytest.mark.parametrize("body", [b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
                                  b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                  b'{"prompt": "\xff"}', b'{"prompt": '],
                         ids=["integer_past_the_digit_limit", "nested_too_deep", "not_utf8", "truncated"])
def test_router_answers_unreadable_bodies_with_a_400(body):
    """Bodies Python's json cannot read are the client's error (a 400 OpenAI error), never a 500,
    decided before any backend is asked (here none answers)."""
    from fastapi.testclient import TestClient

    from blitzllm.router.app import RouterConfig, build_router_app
    app = build_router_app(RouterConfig(backends=("http://127.0.0.1:9",)))
    r = TestClient(app, raise_server_exceptions=False).post("/v1/completions", content=body,
                                                            headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json"
