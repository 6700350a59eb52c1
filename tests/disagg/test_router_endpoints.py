"""``blitz router`` serves every generation endpoint ``blitz serve`` has: the Responses API (with a
stored response's requests sent to the backend that holds it), Anthropic's Messages API, tokenize,
detokenize and version, in replica and disaggregated mode. Against two fake backends without a
model (stickiness, the unknown-id search, a holder that is down, headers, split SSE events) and
the folder's SmolLM2 producer and consumer (answers through the router equal the backend's own)."""
from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time

import anthropic
import httpx
import pytest
from fastapi import FastAPI, Request   # (at the top: the fake's handlers' annotations are strings)
from fastapi.responses import JSONResponse, StreamingResponse

from disagg_helpers import Proc, settled
from tests.server.conftest import free_port
from tests.server.server_helpers import same

MODEL = "smollm2"
ASK = "What is the capital of France?"


# ---- two fake backends, each with its own store of responses ---------------------------------
class Fake:
    """A backend without a model: /health (503 while ``down``), /v1/responses that stores what it
    makes and refuses an unknown previous_response_id with a 404 as blitz serve does (streamed in
    3-byte pieces when asked), GET / DELETE of its stored responses, and an echo of the headers
    it got."""

    ids = itertools.count()

    def __init__(self, name: str):
        import uvicorn

        from tests.server.conftest import free_port
        self.name, self.down, self.store, self.headers = name, False, {}, []
        self.resets, self.idle = 0, True   # /reset_prefix_cache calls; whether it answers reset: true
        app = FastAPI()

        @app.post("/reset_prefix_cache")
        async def reset():
            self.resets += 1
            return {"reset": self.idle}

        def missing(rid):
            return JSONResponse({"error": {"message": f"no stored response has the id '{rid}'", "type":
                                           "invalid_request_error", "param": None, "code": "response_not_found"}},
                                status_code=404)

        @app.get("/health")
        async def health():
            return JSONResponse({"status": "down" if self.down else "ok"}, status_code=503 if self.down else 200)

        @app.post("/v1/responses")
        async def create(request: Request):
            body = await request.json()
            self.headers.append(dict(request.headers))
            prev = body.get("previous_response_id")
            if prev is not None and prev not in self.store:
                return missing(prev)
            resp = {"id": f"resp_{self.name}{next(Fake.ids)}", "object": "response", "store": body.get("store", True),
                    "previous_response_id": prev, "backend": self.name}
            if resp["store"]:
                self.store[resp["id"]] = resp
            if not body.get("stream"):
                return resp
            events = b"".join(f"event: {t}\ndata: {json.dumps({'type': t, 'response': resp})}\n\n".encode()
                              for t in ("response.created", "response.completed"))

            async def pieces():
                for i in range(0, len(events), 3):
                    yield events[i:i + 3]
            return StreamingResponse(pieces(), media_type="text/event-stream")

        @app.get("/v1/responses/{rid}")
        async def get(rid: str):
            return self.store[rid] if rid in self.store else missing(rid)

        @app.delete("/v1/responses/{rid}")
        async def delete(rid: str):
            return {"id": rid, "deleted": True} if self.store.pop(rid, None) else missing(rid)

        self.url = f"http://127.0.0.1:{free_port()}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]),
                                                    log_level="error"))
        threading.Thread(target=self.server.run, daemon=True).start()
        while not self.server.started:
            time.sleep(0.02)


@pytest.fixture(scope="module")
def fakes():
    a, b = Fake("a"), Fake("b")
    yield a, b
    a.server.should_exit = b.server.should_exit = True


def _router(*urls, **cfg):
    from fastapi.testclient import TestClient

    from blitzllm.router.app import RouterConfig, build_router_app
    return TestClient(build_router_app(RouterConfig(backends=tuple(urls), health_interval_s=0.1, **cfg)))


def test_a_conversation_stays_on_the_backend_that_stores_it(fakes):
    """Four chained turns over two replicas, streamed and not: each goes to the backend holding the
    previous response (least-outstanding choice alternates: without stickiness turn 2 is a 404),
    and so do GET and DELETE; the id is read from the streamed response.created even when its
    event arrives in 3-byte pieces."""
    a, b = fakes
    with _router(a.url, b.url) as client:
        for first_stream in (False, True):
            r = client.post("/v1/responses", json={"input": "hi", "stream": first_stream})
            assert r.status_code == 200, r.text
            rid = (r.json() if not first_stream else
                   json.loads(r.text.split("data: ", 1)[1].split("\n", 1)[0])["response"])["id"]
            holder = a if rid in a.store else b
            chain = [rid]
            for turn in range(3):
                r = client.post("/v1/responses", json={"input": "more", "previous_response_id": chain[-1],
                                                       "stream": turn == 1})
                assert r.status_code == 200, r.text
                chain.append(r.json()["id"] if turn != 1 else
                             json.loads(r.text.split("data: ", 1)[1].split("\n", 1)[0])["response"]["id"])
            assert all(i in holder.store for i in chain)
            assert all(client.get(f"/v1/responses/{i}").json()["backend"] == holder.name for i in chain)
            assert client.delete(f"/v1/responses/{chain[0]}").json()["deleted"] is True
            r = client.get(f"/v1/responses/{chain[0]}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
        metrics = client.get("/metrics").text
        assert "blitz_router_responses_pinned_total 16.0" in metrics, metrics


def test_an_unknown_id_is_asked_of_each_backend_and_a_down_holder_is_a_503(fakes):
    """A response the router never saw (made before it started) is found by asking the backends in
    turn, and remembered; while its holder is down, a continuation is a 503 naming that backend,
    not another server's 404; store false is not remembered; x-api-key and anthropic-version pass on."""
    a, b = fakes
    made = httpx.post(b.url + "/v1/responses", json={"input": "direct"}).json()["id"]
    with _router(a.url, b.url) as client:
        assert client.get(f"/v1/responses/{made}").json()["id"] == made
        r = client.post("/v1/responses", json={"input": "on", "previous_response_id": made},
                        headers={"x-api-key": "sesame", "anthropic-version": "2023-06-01"})
        assert r.status_code == 200 and r.json()["backend"] == "b", r.text
        assert b.headers[-1]["x-api-key"] == "sesame" and b.headers[-1]["anthropic-version"] == "2023-06-01"
        r = client.get("/v1/responses/resp_nowhere")     # (every backend asked: its 404)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
        b.down = True
        try:
            deadline = time.monotonic() + 10
            while client.get("/health").json().get("backends", {}).get(b.url):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            for r in (client.post("/v1/responses", json={"input": "on", "previous_response_id": made}),
                      client.get(f"/v1/responses/{made}")):
                assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                err = r.json()["error"]
                assert err["code"] == "backend_down" and b.url in err["message"] and made in err["message"]
            # a new conversation goes to the replica that is up
            assert client.post("/v1/responses", json={"input": "new"}).json()["backend"] == "a"
        finally:
            b.down = False
        before = client.get("/metrics").text
        r = client.post("/v1/responses", json={"input": "x", "store": False})
        assert "blitz_router_response_ids" in before and r.status_code == 200
        assert _gauge(client.get("/metrics").text, "blitz_router_response_ids") == \
            _gauge(before, "blitz_router_response_ids")


def _gauge(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_reset_prefix_cache_reaches_every_backend(fakes):
    a, b = fakes
    with _router(a.url, b.url) as router:
        before = (a.resets, b.resets)
        assert router.post("/reset_prefix_cache").json() == {"reset": True}
        b.idle = False   # one backend still had a request holding blocks: not everything was reset
        try:
            assert router.post("/reset_prefix_cache").json() == {"reset": False}
        finally:
            b.idle = True
        assert (a.resets, b.resets) == (before[0] + 2, before[1] + 2)
    dead = f"http://127.0.0.1:{free_port()}"
    with _router(a.url, dead) as router:
        r = router.post("/reset_prefix_cache")
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_backend" and dead in r.json()["error"]["message"]


def test_router_errors_on_the_new_routes():
    """Wrong methods are 405s, unknown paths 404s; under /v1/messages in Anthropic's error shape;
    with no backend up the new routes are 503 no_backend."""
    with _router("http://127.0.0.1:9") as client:
        for method, path, status in (("GET", "/v1/messages", 405), ("GET", "/tokenize", 405),
                                     ("DELETE", "/v1/responses", 405), ("PUT", "/v1/responses/x", 405),
                                     ("POST", "/version", 405), ("GET", "/v1/responsez", 404)):
            r = client.request(method, path)
            assert r.status_code == status, (method, path, r.text)
            if path.startswith("/v1/messages"):
                assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
            else:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = client.post("/v1/messages", json={"max_tokens": 1, "messages": []})
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error", r.text
        r = client.post("/v1/messages/count_tokens", content=b"{nope")
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        for path in ("/v1/responses", "/v1/embeddings", "/classify", "/v1/score", "/score", "/v1/rerank", "/rerank",
                     "/v2/rerank", "/tokenize", "/detokenize"):
            r = client.post(path, json={})
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_backend", (path, r.text)
        assert client.get("/version").status_code == 503


# ---- real servers: the folder's SmolLM2 producer and consumer --------------------------------
@pytest.fixture(scope="module")
def replica_router(smol, tmp_path_factory):
    r = Proc(["--backend", *(s.url for s in smol), "--health-interval", "0.5"],
             tmp_path_factory.mktemp("router-endpoints"), "router-replicas", cmd="router")
    try:
        yield r.wait_ready(60)
    finally:
        r.stop()


def _sent(router, kind: str) -> float:
    """Requests the router sent to its backends of ``kind``."""
    return sum(v for (name, labels), v in router.labelled_metrics().items()
               if name == "blitz_router_requests_total" and dict(labels)["kind"] == kind)


def _response(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/responses", json={"model": MODEL, "temperature": 0, "max_output_tokens": 12, **body},
                   timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(url: str, **body) -> tuple:
    """(the text of the deltas, the final response) of a streamed response."""
    with httpx.stream("POST", url + "/v1/responses", timeout=300, json={
            "model": MODEL, "temperature": 0, "max_output_tokens": 12, "stream": True, **body}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta"), events[-1]["response"]


def test_responses_through_the_routers_equal_the_backend(smol, replica_router, pd_router):
    """/v1/responses through either router (greedy) equals the consumer's own answer, streamed or
    not; in disaggregated mode it runs whole on the consumer (no prefill hop, no KV pulled)."""
    producer, consumer = smol
    want = _response(consumer.url, input=ASK)
    assert want["output"][0]["content"][0]["text"]
    pulls = consumer.metrics().get("blitz_kv_pulls_ok_total", 0)
    prefills = _sent(pd_router, "prefill")
    for router in (replica_router, pd_router):
        got = _response(router.url, input=ASK)
        assert same(got) == same(want)
        text, final = _streamed(router.url, input=ASK)
        assert text == want["output"][0]["content"][0]["text"] and same(final) == same(want)
    assert consumer.metrics().get("blitz_kv_pulls_ok_total", 0) == pulls
    assert _sent(pd_router, "prefill") == prefills
    settled(*smol)


def test_a_response_chain_through_two_replicas(smol, replica_router):
    """Four chained turns (each continuing the last by previous_response_id, one streamed) through
    a router over two replicas that each keep their own store: all answered by the holder, whose
    last answer equals the same chain run on it directly; GET and DELETE through the router."""
    chain, direct = [], []
    for i, q in enumerate(("Name a fruit.", "Name another.", "And a third?", "Which is sweetest?")):
        prev = {"previous_response_id": chain[-1]["id"]} if chain else {}
        if i == 2:
            chain.append(_streamed(replica_router.url, input=q, **prev)[1])
        else:
            chain.append(_response(replica_router.url, input=q, **prev))
    holders = [s for s in smol if httpx.get(f"{s.url}/v1/responses/{chain[0]['id']}", timeout=30).status_code == 200]
    assert len(holders) == 1
    for i, q in enumerate(("Name a fruit.", "Name another.", "And a third?", "Which is sweetest?")):
        prev = {"previous_response_id": direct[-1]["id"]} if direct else {}
        direct.append(_response(holders[0].url, input=q, **prev))
    assert [same(r["output"]) for r in chain] == [same(r["output"]) for r in direct]
    for r in chain:
        got = httpx.get(f"{replica_router.url}/v1/responses/{r['id']}", timeout=30)
        assert got.status_code == 200 and got.json()["id"] == r["id"], got.text
    gone = httpx.delete(f"{replica_router.url}/v1/responses/{chain[0]['id']}", timeout=30)
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    assert httpx.get(f"{replica_router.url}/v1/responses/{chain[0]['id']}", timeout=30).status_code == 404
    # (cancel: the holder's own answer, a 400: only background responses can be cancelled)
    r = httpx.post(f"{replica_router.url}/v1/responses/{chain[1]['id']}/cancel", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_id", r.text
    settled(*smol)


def test_messages_with_the_anthropic_sdk_through_the_routers(smol, replica_router, pd_router):
    """Anthropic's SDK (x-api-key sent) against either router: the consumer's own Message
    (greedy), the stream's text and final message equal to the whole one, count_tokens equal."""
    consumer = smol[1]
    kw = dict(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": ASK}],
              extra_body={"temperature": 0})

    def sdk(url):
        return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)

    want = sdk(consumer.url).messages.create(**kw)
    n = sdk(consumer.url).messages.count_tokens(model=MODEL, messages=kw["messages"]).input_tokens
    for router in (replica_router, pd_router):
        c = sdk(router.url)
        got = c.messages.create(**kw)
        assert got.content[0].text == want.content[0].text and got.usage.output_tokens == want.usage.output_tokens
        with c.messages.stream(**kw) as st:
            text = "".join(st.text_stream)
            final = st.get_final_message()
        assert text == want.content[0].text and final.stop_reason == want.stop_reason
        assert c.messages.count_tokens(model=MODEL, messages=kw["messages"]).input_tokens == n
    settled(*smol)


def test_tokenize_detokenize_version_through_the_routers(smol, replica_router, pd_router):
    consumer = smol[1]

    def both(method, path, **kw):
        want = httpx.request(method, consumer.url + path, timeout=30, **kw)
        assert want.status_code == 200, want.text
        for router in (replica_router, pd_router):
            got = httpx.request(method, router.url + path, timeout=30, **kw)
            assert got.status_code == 200 and got.json() == want.json(), (router.name, path, got.text)
        return want.json()

    tokens = both("POST", "/tokenize", json={"model": MODEL, "prompt": ASK})["tokens"]
    assert ASK in both("POST", "/detokenize", json={"model": MODEL, "tokens": tokens})["prompt"]
    both("POST", "/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": ASK}]})
    assert both("GET", "/version")["version"]


def test_embeddings_through_the_routers(smol, replica_router, pd_router):
    """/v1/embeddings goes whole to one backend (in disaggregated mode the consumer: one prefill,
    nothing to decode, no KV hand-off): the vectors and usage are the consumer's own."""
    body = {"model": MODEL, "input": [ASK, "Paris"]}
    want = httpx.post(smol[1].url + "/v1/embeddings", json=body, timeout=120)
    assert want.status_code == 200, want.text
    for router in (replica_router, pd_router):
        got = httpx.post(router.url + "/v1/embeddings", json=body, timeout=120)
        assert got.status_code == 200, (router.name, got.text)
        assert got.json()["usage"] == want.json()["usage"] and got.json()["model"] == MODEL
        for g, w in zip(got.json()["data"], want.json()["data"], strict=True):
            assert g["index"] == w["index"] and len(g["embedding"]) == len(w["embedding"])
            assert max(abs(a - b) for a, b in zip(g["embedding"], w["embedding"])) < 1e-4
    sent = _sent(pd_router, "prefill")
    assert httpx.post(pd_router.url + "/v1/embeddings", json=body, timeout=120).status_code == 200
    assert _sent(pd_router, "prefill") == sent
    bad = httpx.post(pd_router.url + "/v1/embeddings", json={"model": "nope", "input": "Hi"}, timeout=30)
    assert bad.status_code == 404 and bad.json()["error"]["param"] == "model"
    for path, req in (("/v1/score", {"text_1": ASK, "text_2": ["Paris", "Berlin"]}),
                      ("/v1/rerank", {"query": ASK, "documents": ["Paris", "Berlin"]})):
        want = httpx.post(smol[1].url + path, json={"model": MODEL, **req}, timeout=120).json()
        got = httpx.post(pd_router.url + path, json={"model": MODEL, **req}, timeout=120)
        assert got.status_code == 200, got.text
        key, field = ("data", "score") if path == "/v1/score" else ("results", "relevance_score")
        assert [x["index"] for x in got.json()[key]] == [x["index"] for x in want[key]]
        assert [x[field] for x in got.json()[key]] == pytest.approx([x[field] for x in want[key]], abs=1e-4)
    assert _sent(pd_router, "prefill") == sent
    settled(*smol)


def test_concurrent_conversations_keep_to_their_holders(smol, replica_router):
    """Eight two-turn conversations at once over two replicas: every second turn finds its first."""
    async def conversation(client, i):
        body = {"model": MODEL, "temperature": 0, "max_output_tokens": 3}
        r = await client.post(replica_router.url + "/v1/responses", json={**body, "input": f"Count to {i}."})
        r2 = await client.post(replica_router.url + "/v1/responses",
                               json={**body, "input": "Again.", "previous_response_id": r.json()["id"]})
        return r2.status_code, r2.text

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(conversation(client, i) for i in range(8)))

    assert all(s == 200 for s, _ in asyncio.run(main()))
    settled(*smol)


def test_prefix_keys_of_messages_and_responses():
    """With --prefix-aware, an Anthropic conversation is keyed by its system prompt and messages, and
    a response's by its instructions and input items: a later turn extends the earlier one's keys."""
    from blitzllm.router.backends import prefix_keys
    from blitzllm.router.bodies import prompt_text

    turn1 = [{"role": "user", "content": "Tell me about the trails near the lake, in detail please."}]
    turn2 = turn1 + [{"role": "assistant", "content": "There are three: the shore path, the ridge and the old mill road."}, {"role": "user", "content": "Which?"}]
    for first, later, other in (
            ({"system": "S" * 70, "messages": turn1}, {"system": "S" * 70, "messages": turn2},
             {"system": "T" * 70, "messages": turn1}),
            ({"instructions": "I" * 70, "input": turn1}, {"instructions": "I" * 70, "input": turn2},
             {"instructions": "I" * 70, "input": "Tell me about the trails"})):
        k1, k2, k3 = (prefix_keys(prompt_text(b)) for b in (first, later, other))
        assert len(k2) > len(k1) >= 2 and k2[:len(k1) - 1] == k1[:-1]   # (the last chunk of turn 1 is partial)
        assert k3[0] != k1[0] or k3[1] != k1[1]
