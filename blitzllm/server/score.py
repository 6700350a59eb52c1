"""vLLM's scoring routes: POST /v1/score (``text_1`` against ``text_2``: one against many, or
pairwise) and POST /v1/rerank (Jina's and Cohere's shape: a query's documents by relevance, the
``top_n`` best). On an embedding model a score is the cosine similarity of the two texts'
embeddings (``embeddings.py``), as vLLM scores with a bi-encoder; on a sequence classifier of one
label (a cross-encoder reranker) it is the head's sigmoid on the pair as one sequence (the
tokenizer's pair encoding), as vLLM's cross-encoder scoring."""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.pooling import cosine, pair_ids, score_pairs
from ..pooling_params import PoolingParams
from .embeddings import base_model_only, embed_inputs
from .errors import bad_request
from .protocol import RerankRequest, ScoreRequest
from .serving import Serving, request_id


def _pairs(s: Serving, left: list, right: list) -> list:
    """Each pair's token ids as one sequence, in a worker thread (texts past the character bound
    refused first)."""
    tok = s.worker_tokenizer("a cross-encoder scores texts, which it must tokenize as pairs")
    for texts, field in ((left, "text_1"), (right, "text_2")):
        for t in dict.fromkeys(texts):
            s.check_prompt_chars(t, field)
    return [pair_ids(tok, a, b) for a, b in zip(left, right)]


async def _scores(s: Serving, raw: Request, base: str, left: list, right: list, truncate, priority) -> tuple:
    """(score per pair, the tokens pooled), or None when the client went away. An embedding
    model embeds each distinct text once; a cross-encoder runs each pair."""
    try:
        params = (PoolingParams(task="score", truncate_prompt_tokens=truncate) if s.classifier
                  else PoolingParams(normalize=True, truncate_prompt_tokens=truncate))
    except ValueError as e:
        raise s._user_error(e, "text_1") from None
    if s.classifier:
        got = await embed_inputs(s, raw, base, await s.cpu(_pairs, s, left, right), params, True, field="text",
                                 priority=priority)
        return None if got is None else ([row[0] for row in got[0]], got[1])
    texts = list(dict.fromkeys(left + right))
    got = await embed_inputs(s, raw, base, texts, params, True, field="text", priority=priority)
    if got is None:
        return None
    vec = dict(zip(texts, got[0]))
    return [cosine(vec[a], vec[b]) for a, b in zip(left, right)], got[1]


async def create_score(s: Serving, req: ScoreRequest, raw: Request) -> Response:
    base_model_only(s, req.model)
    try:
        left, right = score_pairs(req.text_1, req.text_2)
    except ValueError as e:
        raise bad_request(str(e), param="text_1") from None
    base = f"score-{request_id(raw)}"
    got = await _scores(s, raw, base, left, right, s.truncation(req), req.priority)
    if got is None:
        return Response(status_code=499)
    scores, n = got
    return JSONResponse({"id": base, "object": "list", "created": int(time.time()), "model": s.model_name,
                         "data": [{"index": i, "object": "score", "score": v} for i, v in enumerate(scores)],
                         "usage": {"prompt_tokens": n, "total_tokens": n}})


async def create_rerank(s: Serving, req: RerankRequest, raw: Request) -> Response:
    base_model_only(s, req.model)
    base = f"rerank-{request_id(raw)}"
    got = await _scores(s, raw, base, [req.query] * len(req.documents), list(req.documents), s.truncation(req),
                        req.priority)
    if got is None:
        return Response(status_code=499)
    scores, n = got
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if req.top_n:   # (0 or null: every document, as vLLM)
        order = order[:req.top_n]
    return JSONResponse({"id": base, "model": s.model_name, "usage": {"total_tokens": n},
                         "results": [{"index": i, "document": {"text": req.documents[i]}, "relevance_score": scores[i]}
                                     for i in order]})
