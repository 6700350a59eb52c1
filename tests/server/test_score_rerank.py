"""vLLM's POST /v1/score and /v1/rerank (and their /score, /rerank, /v2/rerank aliases) on a real
``blitz serve`` (SmolLM2 fp32 on the CPU, as the offline engine): the scores are ``LLM.score``'s
(cosine similarities of the texts' embeddings, 1e-4), rerank orders the documents by them and
keeps the ``top_n`` best; bad bodies are 400s naming the field."""
from __future__ import annotations

import httpx
import pytest

from tests.server.server_helpers import check_error, wait_idle

QUERY = "What is the capital of France?"
DOCS = ["Bananas are yellow.", "Paris is the capital of France.", "The Eiffel Tower stands in Paris."]


@pytest.fixture(scope="module")
def offline(smollm2_llm):
    import torch
    if torch.cuda.is_available():
        pytest.skip("the server runs bf16 on CUDA; this compares with the CPU's fp32 engine")
    return [o.outputs.score for o in smollm2_llm.score(QUERY, DOCS)]


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json={"model": "smollm2", **body}, headers=srv.headers(), timeout=120)


def test_score_equals_the_engines(smol_f32_server, offline):
    for path in ("/v1/score", "/score"):
        r = post(smol_f32_server, path, {"text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["id"].startswith("score-") and body["model"] == "smollm2"
        assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"score"}
        assert [d["score"] for d in body["data"]] == pytest.approx(offline, abs=1e-4)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    pair = post(smol_f32_server, "/v1/score", {"text_1": [DOCS[0], QUERY], "text_2": [DOCS[0], DOCS[1]]}).json()
    assert [d["score"] for d in pair["data"]] == pytest.approx([1.0, offline[1]], abs=1e-4)
    wait_idle(smol_f32_server)


def test_rerank_orders_by_the_scores(smol_f32_server, offline):
    order = sorted(range(3), key=lambda i: -offline[i])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = post(smol_f32_server, path, {"query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        res = r.json()["results"]
        assert [x["index"] for x in res] == order
        assert [x["document"]["text"] for x in res] == [DOCS[i] for i in order]
        assert [x["relevance_score"] for x in res] == pytest.approx([offline[i] for i in order], abs=1e-4)
    top = post(smol_f32_server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 1}).json()
    assert [x["index"] for x in top["results"]] == order[:1] and top["usage"]["total_tokens"] > 0
    wait_idle(smol_f32_server)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/v1/score", {"text_1": "", "text_2": "x"}, "text_1"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"documents": ["d"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "model": "nope"}, "model"),
])
def test_bad_bodies(smol_f32_server, path, body, param):
    r = httpx.post(smol_f32_server.url + path, json={"model": "smollm2", **body}, timeout=60)
    check_error(r, 404 if param == "model" else 400, param)
