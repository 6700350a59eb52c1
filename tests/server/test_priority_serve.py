"""vLLM's ``priority`` request field: with ``--scheduling-policy priority`` an urgent request (a
chat completion, an embedding of inputs or of messages, a score, a rerank) is answered while a long, less urgent
one still streams (it preempts it: the server runs one sequence at most); under the default fcfs
policy a priority other than 0 is a 400 naming it."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess, _tiny_llama, running
from tests.server.server_helpers import check_error, wait_idle


@pytest.fixture(scope="module")
def priority_server(tmp_path_factory):
    folder = _tiny_llama(tmp_path_factory.mktemp("tiny-llama-prio"))
    srv = ServerProcess(["--model", str(folder), "--served-model-name", "tiny", "--scheduling-policy", "priority",
                         "--max-num-seqs", "1", "--max-model-len", "1024", "--kv-cache-blocks", "128"],
                        tmp_path_factory.mktemp("tiny-prio") / "server.log")
    yield from running(srv)


CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("path, urgent, priority", [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "ignore_eos": True}, -1),
    ("/v1/embeddings", {"input": ["Hi", "Yo"]}, -1),
    ("/v1/embeddings", {"input": ["Hi"]}, 10),   # (less urgent than the long one: it waits for it)
    ("/v1/embeddings", {"messages": CHAT}, -1),
    ("/v1/embeddings", {"messages": CHAT}, 10),
    ("/v1/score", {"text_1": "Hi", "text_2": ["Yo", "Hey"]}, -1),
    ("/v1/rerank", {"query": "Hi", "documents": ["Yo"]}, 10),
])
def test_a_request_is_served_by_its_priority_while_a_long_one_streams(priority_server, path, urgent, priority):
    srv = priority_server
    before = srv.metrics()["blitz_num_preemptions_total"]
    events = {}

    def long_one():
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True,
                "temperature": 0, "stream": True, "priority": 5}
        n = 0
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    n += 1
                    events.setdefault("started", time.monotonic())
                    if json.loads(line[6:])["choices"][0]["finish_reason"]:
                        events["long_done"] = time.monotonic()
        events["chunks"] = n

    t = threading.Thread(target=long_one)
    t.start()
    deadline = time.monotonic() + 60
    while "started" not in events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "started" in events
    r = httpx.post(srv.url + path, timeout=60, json={"model": "tiny", **urgent, "priority": priority})
    answered = time.monotonic()
    assert r.status_code == 200, r.text
    if path == "/v1/embeddings":
        assert len(r.json()["data"]) == len(urgent.get("input", [None]))
    elif path == "/v1/score":
        assert len(r.json()["data"]) == 2
    elif path == "/v1/rerank":
        assert len(r.json()["results"]) == 1
    else:
        assert r.json()["usage"]["completion_tokens"] == 4
    t.join(120)
    assert events["chunks"] >= 2
    m = wait_idle(srv)
    if priority > 5:
        # served after the long one ended. (Two client threads read the two sockets: the stream's
        # last chunk, which the server sends first, was once read 0.3 ms after the answer; served
        # while the stream ran (0.4 s here), the answer would come long before it ends.)
        assert events["long_done"] < answered + 0.05 and m["blitz_num_preemptions_total"] == before
    else:
        assert events["long_done"] > answered   # not after the long one ended: it was preempted
        assert m["blitz_num_preemptions_total"] >= before + 1


def test_responses_take_a_priority(priority_server):
    r = httpx.post(priority_server.url + "/v1/responses", timeout=60,
                   json={"model": "tiny", "input": "Hi", "max_output_tokens": 3, "priority": 2})
    assert r.status_code == 200, r.text


def test_priority_under_fcfs_is_a_400(tiny_server):
    srv = tiny_server
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/responses", {"input": "Hi"}), ("/v1/embeddings", {"input": "Hi"}),
                       ("/v1/embeddings", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/score", {"text_1": "Hi", "text_2": "Yo"}), ("/v1/rerank", {"query": "Hi", "documents": ["Yo"]})):
        r = httpx.post(srv.url + path, headers=srv.headers(), timeout=60,
                       json={"model": "tiny", "max_tokens" if path != "/v1/responses" else "max_output_tokens": 2,
                             **body, "priority": 3})
        err = check_error(r, 400, "priority")
        assert "--scheduling-policy priority" in err["message"]
    r = httpx.post(srv.url + "/v1/completions", headers=srv.headers(), timeout=60,
                   json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, "priority": 0})
    assert r.status_code == 200, r.text
    wait_idle(srv)
