"""POST /classify, and /v1/score and /v1/rerank on a cross-encoder, on real ``blitz serve``
processes of tiny random sequence classifiers (float32 on the CPU): the probabilities are
transformers' softmax of its logits (the scores its sigmoid of the pair encoding's logit), 1e-4;
the labels are the config's id2label of the most likely class; the answers validate against the
documented models; refusals are OpenAI-style 400s; no KV block is left behind."""
from __future__ import annotations

import httpx
import pytest

from blitzllm.server.classify import ClassificationResponse
from blitzllm.server.protocol import RerankResponse, ScoreResponse
from tests.classifiers import LABELS, hf_logits, make_tiny_classifier, tiny_tokenizer
from tests.server.conftest import ServerProcess, running
from tests.server.server_helpers import check_error, wait_idle

TEXTS = ["what is the capital of france ?", "hello", "the quick brown fox jumps over the lazy dog . " * 3]
QUERY = "what is the capital of france ?"
DOCS = ["bananas are yellow .", "paris is the capital of france .", "the eiffel tower stands in paris ."]


def _server(tmp_path_factory, arch: str, num_labels: int, name: str):
    folder = tmp_path_factory.mktemp(name)
    hf = make_tiny_classifier(arch, folder, num_labels)
    srv = ServerProcess(["--model", str(folder), "--served-model-name", name, "--dtype", "float32",
                         "--max-model-len", "64", "--kv-cache-blocks", "64", "--max-num-batched-tokens", "16"],
                        tmp_path_factory.mktemp(name) / "server.log")
    return srv, hf


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    srv, hf = _server(tmp_path_factory, "qwen3", 3, "cls")
    for s in running(srv):
        yield s, hf


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    srv, hf = _server(tmp_path_factory, "llama", 1, "rerank")
    for s in running(srv):
        yield s, hf


def post(srv, path: str, body: dict, model: str) -> httpx.Response:
    return httpx.post(srv.url + path, json={"model": model, **body}, timeout=120)


def test_classify_is_transformers_softmax_with_its_labels(classifier):
    srv, hf = classifier
    tok = tiny_tokenizer()
    ids = [tok(t).input_ids for t in TEXTS]
    assert len(ids[2]) > 16   # (prefilled in chunks: --max-num-batched-tokens 16)
    r = post(srv, "/classify", {"input": TEXTS}, "cls")
    assert r.status_code == 200, r.text
    body = r.json()
    ClassificationResponse.model_validate(body)
    assert body["id"].startswith("classify-") and body["object"] == "list" and body["model"] == "cls"
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids)),
                             "completion_tokens": 0, "prompt_tokens_details": None}
    for i, (d, p) in enumerate(zip(body["data"], ids, strict=True)):
        want = hf_logits(hf, p).softmax(-1)
        assert d["index"] == i and d["num_classes"] == 3
        assert d["probs"] == pytest.approx(want.tolist(), abs=1e-4)
        assert d["label"] == LABELS[int(want.argmax())]
    # token ids, one text, truncation, raw logits
    one = post(srv, "/classify", {"input": ids[2], "truncate_prompt_tokens": 5, "use_activation": False}, "cls").json()
    assert one["usage"]["prompt_tokens"] == 5
    assert one["data"][0]["probs"] == pytest.approx(hf_logits(hf, ids[2][-5:]).tolist(), abs=1e-4)
    text = post(srv, "/classify", {"input": TEXTS[1], "add_special_tokens": False}, "cls").json()
    want = hf_logits(hf, tok(TEXTS[1], add_special_tokens=False).input_ids).softmax(-1)
    assert text["data"][0]["probs"] == pytest.approx(want.tolist(), abs=1e-4)
    m = wait_idle(srv)
    assert m["blitz_kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("body,status,param,says", [
    ({"input": []}, 400, "input", None),
    ({"input": [5, 999]}, 400, "input", "token ids must be in [0, 320)"),
    ({"input": "hello", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", None),
    ({"input": "hello", "priority": 3}, 400, "priority", "priority scheduling"),
    ({"input": list(range(3, 70))}, 400, "input", "max_model_len=64"),
    ({"input": "hello", "model": "nope"}, 404, "model", None),
])
def test_classify_refusals(classifier, body, status, param, says):
    srv, _ = classifier
    err = check_error(post(srv, "/classify", body, "cls"), status, param)   # (a body's model wins)
    assert says is None or says in err["message"], err
    wait_idle(srv)


def test_a_classifier_does_not_generate_embed_or_score_with_three_labels(classifier):
    srv, _ = classifier
    err = check_error(post(srv, "/v1/completions", {"prompt": "hello", "max_tokens": 2}, "cls"), 400, "prompt")
    assert "sequence classifier (Qwen3ForSequenceClassification)" in err["message"] and "not generate" in err["message"]
    err = check_error(post(srv, "/v1/embeddings", {"input": "hello"}, "cls"), 400, None)
    assert "not embed" in err["message"]
    err = check_error(post(srv, "/v1/score", {"text_1": QUERY, "text_2": DOCS}, "cls"), 400, None)
    assert "has 3 labels" in err["message"]
    m = wait_idle(srv)
    assert m["blitz_kv_cache_usage_perc"] == 0


def test_cross_encoder_score_and_rerank(cross_encoder):
    srv, hf = cross_encoder
    tok = tiny_tokenizer()
    want = [float(hf_logits(hf, tok(QUERY, d).input_ids).sigmoid()[0]) for d in DOCS]
    r = post(srv, "/v1/score", {"text_1": QUERY, "text_2": DOCS}, "rerank")
    assert r.status_code == 200, r.text
    body = ScoreResponse.model_validate(r.json())
    assert [d.score for d in body.data] == pytest.approx(want, abs=1e-4)
    assert body.usage.prompt_tokens == sum(len(tok(QUERY, d).input_ids) for d in DOCS)
    order = sorted(range(3), key=lambda i: -want[i])
    for path in ("/v1/rerank", "/rerank"):
        res = RerankResponse.model_validate(post(srv, path, {"query": QUERY, "documents": DOCS}, "rerank").json())
        assert [x.index for x in res.results] == order
        assert [x.relevance_score for x in res.results] == pytest.approx([want[i] for i in order], abs=1e-4)
    top = post(srv, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2}, "rerank").json()
    assert [x["index"] for x in top["results"]] == order[:2]
    c = post(srv, "/classify", {"input": QUERY}, "rerank").json()["data"][0]
    assert c["label"] == "relevance" and c["num_classes"] == 1
    assert c["probs"] == pytest.approx(hf_logits(hf, tok(QUERY).input_ids).sigmoid().tolist(), abs=1e-4)
    err = check_error(post(srv, "/v1/score", {"text_1": "x " * 70, "text_2": "y"}, "rerank"), 400, None)
    assert "max_model_len=64" in err["message"]
    m = wait_idle(srv)
    assert m["blitz_kv_cache_usage_perc"] == 0


def test_an_embedding_model_does_not_classify(smol_f32_server):
    err = check_error(post(smol_f32_server, "/classify", {"input": "Hi"}, "smollm2"), 400, "input")
    assert "the classify task needs a sequence classifier" in err["message"]
    wait_idle(smol_f32_server)


def test_the_router_forwards_classify(classifier):
    """``blitz router`` sends /classify whole to a backend: the answer is the backend's."""
    from fastapi.testclient import TestClient

    from blitzllm.router.app import RouterConfig, build_router_app
    srv, _ = classifier
    want = post(srv, "/classify", {"input": TEXTS}, "cls").json()
    with TestClient(build_router_app(RouterConfig(backends=(srv.url,), health_interval_s=0.1))) as client:
        got = client.post("/classify", json={"model": "cls", "input": TEXTS})
        assert got.status_code == 200, got.text
        bad = client.post("/classify", json={"model": "cls", "input": []})
    assert got.json()["usage"] == want["usage"] and got.json()["model"] == "cls"
    for g, w in zip(got.json()["data"], want["data"], strict=True):   # (the prefix cache may serve it: 1e-5)
        assert (g["index"], g["label"]) == (w["index"], w["label"]) and g["probs"] == pytest.approx(w["probs"], abs=1e-5)
    check_error(bad, 400, "input")
    wait_idle(srv)
