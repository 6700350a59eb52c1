"""The OpenAPI 3.1 schema of ``/openapi.json`` (and ``/docs``, ``/redoc``): FastAPI's paths, with
each operation's request body and responses taken from the pydantic models of ``protocol.py``
(``responses_protocol.py``, ``messages_protocol.py``).
The routes parse their bodies themselves (size limit, worker threads, OpenAI-style errors), so
FastAPI cannot see those models; this table says which goes where (a tuple of request models:
a body of one of those forms, as the route picks by its fields)."""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from . import classify as C
from . import messages_protocol as M
from . import protocol as P
from . import responses_protocol as R

_JSON = "application/json"
_SSE = "text/event-stream"
_REF = "#/components/schemas/{model}"

_ERRORS = {400: "a bad request: the field is named in `param`", 401: "a missing or wrong API key",
           404: "an unknown model, route or stored response", 413: "the body is over --max-request-bytes",
           500: "the engine failed while running the request",
           503: "the model is loading, the queue is full or the server is stopping (see Retry-After)"}

# (path, method) -> (request model, 200 model, the event model of a stream, error statuses, summary)
_OPS = {
    ("/v1/chat/completions", "post"): (P.ChatCompletionRequest, P.ChatCompletionResponse, P.ChatCompletionChunk,
                                       (400, 401, 404, 413, 500, 503), "Create a chat completion"),
    ("/v1/completions", "post"): (P.CompletionRequest, P.CompletionResponse, P.CompletionResponse,
                                  (400, 401, 404, 413, 500, 503), "Create a completion"),
    ("/v1/embeddings", "post"): ((P.EmbeddingRequest, P.EmbeddingChatRequest), P.EmbeddingResponse, None,
                                 (400, 401, 404, 413, 500, 503),
                                 "Create embeddings (the model's pooled final hidden states) of inputs, or of chat "
                                 "messages (vLLM's)"),
    ("/classify", "post"): (C.ClassificationRequest, C.ClassificationResponse, None, (400, 401, 404, 413, 500, 503),
                            "Classify inputs with a sequence classifier: class probabilities and labels (vLLM's)"),
    ("/v1/score", "post"): (P.ScoreRequest, P.ScoreResponse, None, (400, 401, 404, 413, 500, 503),
                            "Score text pairs: their embeddings' cosine similarity, or a cross-encoder's score "
                            "of the pair (vLLM's)"),
    ("/v1/rerank", "post"): (P.RerankRequest, P.RerankResponse, None, (400, 401, 404, 413, 500, 503),
                             "Rank documents by their score against a query, as /v1/score's (vLLM's; Jina's, "
                             "Cohere's)"),
    ("/v1/models", "get"): (None, P.ModelList, None, (401,), "List the served model and its LoRA adapters"),
    ("/v1/models/{model_id}", "get"): (None, P.ModelCard, None, (401, 404), "The served model"),
    ("/tokenize", "post"): (P.TokenizeRequest, P.TokenizeResponse, None, (400, 401, 404, 413, 503),
                            "Tokenize a prompt or chat messages"),
    ("/detokenize", "post"): (P.DetokenizeRequest, P.DetokenizeResponse, None, (400, 401, 404, 413, 503),
                              "Turn token ids into text"),
    ("/health", "get"): (None, P.HealthResponse, None, (503,), "200 once the model has loaded"),
    ("/version", "get"): (None, P.VersionResponse, None, (), "The installed blitzllm's version"),
    ("/reset_prefix_cache", "post"): (None, P.ResetPrefixCacheResponse, None, (401, 503),
                                      "Forget every cached prefix (vLLM's; only while no request holds KV blocks)"),
    ("/v1/responses", "post"): (R.ResponsesRequest, R.ResponseObject, R.ResponseStreamEvent,
                                (400, 401, 404, 413, 500, 503), "Create a response (OpenAI's Responses API)"),
    ("/v1/responses/{response_id}", "get"): (None, R.ResponseObject, None, (401, 404), "A stored response"),
    ("/v1/responses/{response_id}", "delete"): (None, R.DeletedResponse, None, (401, 404),
                                                "Delete a stored response"),
    ("/v1/responses/{response_id}/cancel", "post"): (None, R.ResponseObject, None, (400, 401, 404),
                                                     "Cancel a background response (none run here: a 400)"),
    ("/v1/messages", "post"): (M.MessagesRequest, M.MessageObject, M.MessageStreamEvent,
                               (400, 401, 404, 413, 500, 503), "Create a message (Anthropic's Messages API)"),
    ("/v1/messages/count_tokens", "post"): (M.CountTokensRequest, M.TokenCount, None, (400, 401, 404, 413, 503),
                                            "Count a message request's prompt tokens (Anthropic's)"),
}
_GUARDED = {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/classify", "/v1/score", "/v1/rerank", "/v1/models", "/v1/models/{model_id}",
            "/tokenize", "/detokenize", "/reset_prefix_cache", "/v1/responses", "/v1/responses/{response_id}",
            "/v1/responses/{response_id}/cancel",
            "/v1/messages", "/v1/messages/count_tokens"}
# (a Responses stream ends with its response.completed / .incomplete event, a Messages one with message_stop)
_NO_DONE = {R.ResponseStreamEvent, M.MessageStreamEvent}
_ERROR_BODY = {"/v1/messages": M.AnthropicError, "/v1/messages/count_tokens": M.AnthropicError}  # (else OpenAI's)


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": _REF.format(model=model.__name__)}


def _content(model: type[BaseModel], stream: Optional[type[BaseModel]]) -> dict:
    content = {_JSON: {"schema": _ref(model)}}
    if stream is not None:
        # OpenAPI 3.1 has no `itemSchema`: a stream's `schema` describes one event (data, event, id, retry)
        done = "" if stream in _NO_DONE else "; the last event's is `[DONE]`"
        data = {"type": "string", "description": f"a {stream.__name__} as JSON{done}"}
        event = {"data": data, "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}
        content[_SSE] = {"schema": {"type": "object", "required": ["data"], "properties": event,
                                    "description": "with `stream`: one server-sent event"}}
    return content


_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _json_schema_bounds(node):
    """pydantic writes a bound of a number whose type has a before-validator (``protocol.Int``)
    as the constraint's own name (``ge``), which JSON Schema does not know, so clients and
    validators would not see it: renamed to JSON Schema's keywords."""
    if isinstance(node, list):
        return [_json_schema_bounds(v) for v in node]
    if not isinstance(node, dict):
        return node
    number = node.get("type") in ("integer", "number")
    return {(_BOUNDS[k] if number and k in _BOUNDS else k): _json_schema_bounds(v) for k, v in node.items()}


def build_openapi(base: dict, api_key: bool) -> dict:
    """``base``: FastAPI's ``get_openapi`` document of the app's routes."""
    doc = dict(base)
    requests = [m for r, *_ in _OPS.values() if r is not None for m in (r if isinstance(r, tuple) else (r,))]
    responses = {m for _, m, s, *_ in _OPS.values()} | {s for _, _, s, *_ in _OPS.values() if s} | \
        {P.ErrorResponse, *_ERROR_BODY.values()}
    _, defs = models_json_schema([(m, "validation") for m in requests]
                                 + [(m, "serialization") for m in sorted(responses, key=lambda m: m.__name__)],
                                 ref_template=_REF)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for stale in ("HTTPValidationError", "ValidationError"):
        schemas.pop(stale, None)
    schemas.update(_json_schema_bounds(defs.get("$defs", {})))
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                    "description": "--api-key (the scheme in any case)"},
                                         "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key",
                                                       "description": "--api-key, as Anthropic's clients send it"}}
    request_id = {"name": "X-Request-Id", "in": "header", "required": False,
                  "description": "the request's id (echoed; generated when absent)", "schema": {"type": "string"}}
    id_header = {"X-Request-Id": {"description": "the request's id", "schema": {"type": "string"}}}
    for path, methods in doc.get("paths", {}).items():
        for method, op in methods.items():
            spec = _OPS.get((path, method))
            op["parameters"] = [p for p in op.get("parameters", ()) if p.get("name") != "X-Request-Id"] + [request_id]
            if spec is None:  # /metrics
                op["responses"] = {"200": {"description": "Prometheus metrics", "headers": id_header,
                                           "content": {"text/plain": {"schema": {"type": "string"}}}}}
                continue
            req, ok, stream, errors, summary = spec
            op["summary"] = summary
            if req is not None:
                schema = {"oneOf": [_ref(m) for m in req]} if isinstance(req, tuple) else _ref(req)
                op["requestBody"] = {"required": True, "content": {_JSON: {"schema": schema}}}
            op["responses"] = {"200": {"description": "OK", "headers": id_header, "content": _content(ok, stream)}}
            error = _ref(_ERROR_BODY.get(path, P.ErrorResponse))
            for status in errors:
                op["responses"][str(status)] = {"description": _ERRORS[status], "headers": id_header,
                                                "content": {_JSON: {"schema": error}}}
            if api_key and path in _GUARDED:
                op["security"] = [{"bearer": []}, {"x-api-key": []}]   # (either)
    return doc
