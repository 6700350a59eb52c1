"""Issue 36, finding 3 / acceptance 3: /openapi.json is a valid OpenAPI 3 document describing the
real request and response models (real responses validate against it), /docs and /redoc serve
it, and a bounded schemathesis run over every operation of a live server finds no server error."""
from __future__ import annotations

import json

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_schema_conformance, status_code_conformance)

from blitzllm.server import classify as C
from blitzllm.server import messages_protocol as M
from blitzllm.server import protocol as P
from blitzllm.server import responses_protocol as R

CHAT, CMPL, RESP = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MSG, COUNT, EMB = "/v1/messages", "/v1/messages/count_tokens", "/v1/embeddings"
MAX_EXAMPLES = 25   # per operation and generation mode: a few hundred cases in all
OPERATIONS = {("POST", CHAT), ("POST", CMPL), ("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/health"), ("GET", "/metrics"),
              ("GET", "/version"), ("POST", RESP), ("GET", RESP + "/{response_id}"),
              ("DELETE", RESP + "/{response_id}"), ("POST", RESP + "/{response_id}/cancel"), ("POST", MSG),
              ("POST", COUNT), ("POST", EMB), ("POST", "/reset_prefix_cache"), ("POST", "/v1/score"),
              ("POST", "/v1/rerank"), ("POST", "/classify")}
# (the operations with a body)
BODIES = {("POST", p) for p in (CHAT, CMPL, RESP, MSG, COUNT, EMB, "/tokenize", "/detokenize", "/v1/score",
                                "/v1/rerank", "/classify")}


def test_openapi_json_is_valid_openapi_3(smol_server):
    from openapi_spec_validator import validate
    r = httpx.get(smol_server.url + "/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    doc = r.json()
    assert doc["openapi"].startswith("3.")
    validate(doc)
    ops = {(m.upper(), path) for path, item in doc["paths"].items() for m in item}
    assert ops == OPERATIONS
    def names(schema) -> object:   # (a body of two forms: oneOf their models)
        refs = [s["$ref"].rsplit("/", 1)[1] for s in schema.get("oneOf", [schema])]
        return refs[0] if "$ref" in schema else tuple(refs)

    body = {path: names(item["post"]["requestBody"]["content"]["application/json"]["schema"])
            for path, item in doc["paths"].items() if "requestBody" in item.get("post", {})}
    assert body == {CHAT: "ChatCompletionRequest", CMPL: "CompletionRequest", "/tokenize": "TokenizeRequest",
                    "/detokenize": "DetokenizeRequest", RESP: "ResponsesRequest", MSG: "MessagesRequest",
                    COUNT: "CountTokensRequest", EMB: ("EmbeddingRequest", "EmbeddingChatRequest"),
                    "/v1/score": "ScoreRequest", "/v1/rerank": "RerankRequest", "/classify": "ClassificationRequest"}
    assert doc["components"]["schemas"]["EmbeddingChatRequest"]["required"] == ["messages"]
    chat = doc["paths"][CHAT]["post"]["responses"]
    assert chat["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionResponse")
    assert "text/event-stream" in chat["200"]["content"]
    assert chat["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "422" not in chat
    for path in (MSG, COUNT):   # (Anthropic's error body on its routes)
        assert {doc["paths"][path]["post"]["responses"][s]["content"]["application/json"]["schema"]["$ref"]
                for s in ("400", "404")} == {"#/components/schemas/AnthropicError"}
    assert "text/event-stream" in doc["paths"][MSG]["post"]["responses"]["200"]["content"]
    # the request models are the ones the server parses with, field for field (by the names clients send)
    for name, model in (("ChatCompletionRequest", P.ChatCompletionRequest), ("CompletionRequest", P.CompletionRequest),
                        ("ResponsesRequest", R.ResponsesRequest), ("MessagesRequest", M.MessagesRequest),
                        ("CountTokensRequest", M.CountTokensRequest), ("EmbeddingRequest", P.EmbeddingRequest),
                        ("EmbeddingChatRequest", P.EmbeddingChatRequest),
                        ("ScoreRequest", P.ScoreRequest), ("RerankRequest", P.RerankRequest),
                        ("ClassificationRequest", C.ClassificationRequest)):
        assert set(doc["components"]["schemas"][name]["properties"]) == \
            {f.alias or key for key, f in model.model_fields.items()}
    assert "stop_sequences" in doc["components"]["schemas"]["MessagesRequest"]["properties"]
    assert doc["paths"]["/classify"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"] \
        .endswith("/ClassificationResponse")

    def bounds(node) -> None:   # a number's bounds in JSON Schema's words, not pydantic's ge / le
        if isinstance(node, dict):
            assert not (node.get("type") in ("integer", "number") and {"ge", "le", "gt", "lt"} & set(node)), node
            for v in node.values():
                bounds(v)
        elif isinstance(node, list):
            for v in node:
                bounds(v)

    bounds(doc)
    pen = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["presence_penalty"]["anyOf"][0]
    field = {type(m).__name__: m for m in P.ChatCompletionRequest.model_fields["presence_penalty"].metadata}
    assert (pen["minimum"], pen["maximum"]) == (field["Ge"].ge, field["Le"].le)
    top = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["top_logprobs"]["anyOf"][0]
    assert (top["minimum"], "maximum" in top) == (0, False)  # (the cap is the server's --max-logprobs)
    for path in ("/docs", "/redoc"):
        page = httpx.get(smol_server.url + path)
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "/openapi.json" in page.text


def _events(text: str, done: bool = True) -> list:
    """A stream's events; ``done``: ended by ``[DONE]`` (a Responses stream is not)."""
    lines = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
    assert (lines[-1] == "[DONE]") == done
    return [json.loads(x) for x in lines[:len(lines) - done]]


def test_real_responses_are_the_documented_models(smol_server):
    """Each endpoint's answers (plain dicts in serving.py) validate against protocol.py's response
    models, which forbid undocumented fields."""
    url = smol_server.url
    msg = [{"role": "user", "content": "Hi"}]
    P.ChatCompletionResponse.model_validate(httpx.post(url + CHAT, json={"messages": msg, "max_tokens": 3, "logprobs": True,
                                                                         "top_logprobs": 2, "n": 2}, timeout=60).json())
    for ev in _events(httpx.post(url + CHAT, json={"messages": msg, "max_tokens": 3, "stream": True, "logprobs": True,
                                                   "stream_options": {"include_usage": True}}, timeout=60).text):
        P.ChatCompletionChunk.model_validate(ev)
    P.CompletionResponse.model_validate(httpx.post(url + CMPL, json={"prompt": ["Hi", "Yo"], "max_tokens": 3,
                                                                     "logprobs": 2, "echo": False}, timeout=60).json())
    for ev in _events(httpx.post(url + CMPL, json={"prompt": "Hi", "max_tokens": 3, "stream": True, "echo": True,
                                                   "stream_options": {"include_usage": True}}, timeout=60).text):
        P.CompletionResponse.model_validate(ev)
    for fmt in ("float", "base64"):
        emb = P.EmbeddingResponse.model_validate(httpx.post(url + EMB, json={"input": ["Hi", "Yo"], "encoding_format": fmt},
                                                            timeout=60).json())
        assert len(emb.data) == 2 and isinstance(emb.data[0].embedding, list if fmt == "float" else str)
        emb = P.EmbeddingResponse.model_validate(httpx.post(url + EMB, json={"messages": msg, "encoding_format": fmt},
                                                            timeout=60).json())
        assert len(emb.data) == 1
    assert len(P.ScoreResponse.model_validate(httpx.post(url + "/v1/score", json={"text_1": "Hi", "text_2": ["a", "b"]},
                                                         timeout=60).json()).data) == 2
    assert len(P.RerankResponse.model_validate(httpx.post(url + "/v1/rerank", json={"query": "Hi", "documents": ["a", "b"]},
                                                          timeout=60).json()).results) == 2
    P.ModelList.model_validate(httpx.get(url + "/v1/models").json())
    P.ModelCard.model_validate(httpx.get(url + "/v1/models/smollm2").json())
    P.TokenizeResponse.model_validate(httpx.post(url + "/tokenize", json={"messages": msg}).json())
    P.DetokenizeResponse.model_validate(httpx.post(url + "/detokenize", json={"tokens": [1, 2, 3]}).json())
    P.HealthResponse.model_validate(httpx.get(url + "/health").json())
    resp = R.ResponseObject.model_validate(httpx.post(url + RESP, json={"input": "Hi", "max_output_tokens": 3,
                                                                       "include": ["message.output_text.logprobs"],
                                                                       "top_logprobs": 2}, timeout=60).json())
    assert resp.output[0].content[0].logprobs
    R.ResponseObject.model_validate(httpx.get(f"{url}{RESP}/{resp.id}").json())
    events = _events(httpx.post(url + RESP, json={"input": "Hi", "max_output_tokens": 3, "stream": True},
                                timeout=60).text, done=False)
    for ev in events:
        R.ResponseStreamEvent.model_validate(ev)
    assert events[-1]["type"] == "response.incomplete"
    R.DeletedResponse.model_validate(httpx.delete(f"{url}{RESP}/{resp.id}").json())
    ask = {"model": "smollm2", "max_tokens": 3, "messages": msg}
    M.MessageObject.model_validate(httpx.post(url + MSG, json=ask, timeout=60).json())
    M.TokenCount.model_validate(httpx.post(url + COUNT, json={"model": "smollm2", "messages": msg}, timeout=60).json())
    events = _events(httpx.post(url + MSG, json={**ask, "stream": True}, timeout=60).text, done=False)
    for ev in events:
        M.MessageStreamEvent.model_validate(ev)
    assert events[-1]["type"] == "message_stop"
    for r in (httpx.post(url + MSG, json={**ask, "max_tokens": "3"}), httpx.post(url + COUNT, json={"messages": msg}),
              httpx.post(url + MSG, json={**ask, "model": "nope"})):
        M.AnthropicError.model_validate(r.json())
    for r in (httpx.post(url + CMPL, json={"prompt": 5}), httpx.get(url + "/v1/models/nope"),
              httpx.post(url + EMB, json={"input": []}),
              httpx.post(url + CHAT, content=b"{"), httpx.get(f"{url}{RESP}/{resp.id}"),
              httpx.post(url + RESP, json={"input": "Hi", "tools": [{"type": "mcp"}]})):
        P.ErrorResponse.model_validate(r.json())


# ---- schemathesis -----------------------------------------------------------------------------
CHECKS = [not_a_server_error, content_type_conformance, response_schema_conformance, status_code_conformance,
          negative_data_rejection]


def bounded(case) -> None:
    """Name the served model; keep generations short (max_tokens <= 4, n <= 4, and 4 where a body
    leaves it out); other fields as generated. A value that is not an integer stays as generated:
    a negative case's mutation must reach the server as sent (made 4, the server would rightly
    accept it, and the negative-data check would fail)."""
    body = case.body
    if not isinstance(body, dict):
        return
    # (any other name is a 404 before the engine sees the request; an empty one may be a negative case's
    # minLength violation, which must reach the server as sent)
    if isinstance(body.get("model"), str) and body["model"]:
        body["model"] = "smollm2"
    if case.path not in (CHAT, CMPL, RESP, MSG):
        return
    for key, top in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 4), ("best_of", 4),
                     ("max_output_tokens", 4)):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > top:
            body[key] = top
    if case.path == RESP:
        if body.get("max_output_tokens") is None:
            body["max_output_tokens"] = 4
    elif case.path == MSG:
        if body.get("max_tokens") is None:
            body["max_tokens"] = 4
    elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4


def test_schemathesis_finds_no_server_error(smol_server):
    """Every operation, MAX_EXAMPLES positive and MAX_EXAMPLES negative cases each (derandomized:
    the same cases every run), through the response checks: no 5xx, status codes, content types
    and bodies as documented, and schema-violating input refused."""
    schema = schemathesis.openapi.from_url(smol_server.url + "/openapi.json")
    counts: dict = {}
    statuses: dict = {}
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            def run(case):
                bounded(case)
                key = (case.method.upper(), case.path, mode.value)
                counts[key] = counts.get(key, 0) + 1
                r = case.call_and_validate(base_url=smol_server.url, timeout=120, checks=CHECKS)
                statuses[key[:2] + (r.status_code,)] = statuses.get(key[:2] + (r.status_code,), 0) + 1

            try:
                run()
            except Unsatisfiable:  # nothing to negate (an operation whose only inputs are a header and a path)
                assert mode == GenerationMode.NEGATIVE and (op.method.upper(), op.path) not in BODIES, op
    assert {(m, p) for m, p, _ in counts} == OPERATIONS
    assert {(m, p) for m, p, mode in counts if mode == "negative"} >= BODIES
    print(f"schemathesis: {sum(counts.values())} cases: "
          + ", ".join(f"{m} {p} {mode} {n}" for (m, p, mode), n in sorted(counts.items())))
    print(f"statuses: {sorted(statuses.items())}")
    assert sum(counts.values()) >= 300
    assert all(statuses.get(("POST", path, 200), 0) >= 5 for path in (CHAT, CMPL, RESP, MSG, COUNT, EMB, "/tokenize",
                                                                      "/detokenize"))


def test_streams_conform_to_their_documented_events(smol_server):
    """A streamed chat completion and completion, through the same checks: each server-sent
    event as the schema documents one (the generated cases above reach a stream only by chance)."""
    schema = schemathesis.openapi.from_url(smol_server.url + "/openapi.json")
    bodies = {CHAT: {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                     "stream": True},
              CMPL: {"model": "smollm2", "prompt": "One, two,", "max_tokens": 3, "stream": True, "echo": True,
                     "logprobs": 1},
              RESP: {"model": "smollm2", "input": "Hi", "max_output_tokens": 3, "stream": True},
              MSG: {"model": "smollm2", "max_tokens": 3, "stream": True,
                    "messages": [{"role": "user", "content": "Hi"}]}}
    for path, body in bodies.items():
        op = schema[path]["POST"]
        r = op.Case(body=body, media_type="application/json").call_and_validate(
            base_url=smol_server.url, timeout=120, checks=CHECKS)
        assert r.status_code == 200 and r.headers["content-type"][0].startswith("text/event-stream")
        assert r.text.count("data: ") >= 3
        ends = {RESP: '"type":"response.incomplete"', MSG: '"type":"message_stop"'}
        assert r.text.rstrip().endswith("data: [DONE]") if path not in ends else ends[path] in r.text
