"""``blitz run-batch`` (vLLM's run-batch, OpenAI's Batch API file format), run as a user runs it,
in its own process on SmolLM2 in float32: every answer equals the offline engine's (the
``smollm2_llm`` fixture: greedy texts, embeddings and scores), lines come back in the input's
order whatever order they finish in, refused requests carry the server's error object, and
http(s) input and output go by GET and PUT. A malformed file stops before the model loads, with
one line and exit status 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from blitzllm import SamplingParams
from blitzllm.cli import main

ENGINE = ["--model", "smollm2", "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "2"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["The capital of France is", "One, two, three,", "My favourite food is", "The sky is",
           "Water boils at", "The largest planet is"]
DOCS = ["Paris is the capital of France.", "Bananas are yellow."]


def _req(cid: str, url: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


REQUESTS = [
    _req("chat", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 12, "temperature": 0}),
    *[_req(f"c{i}", "/v1/completions", {"prompt": p, "max_tokens": 10, "temperature": 0})
      for i, p in enumerate(PROMPTS)],
    _req("embed", "/v1/embeddings", {"input": DOCS}),
    _req("bad", "/v1/completions", {"prompt": "Hi", "max_tokens": -1}),
    _req("stream", "/v1/chat/completions", {"messages": CHAT, "stream": True}),
    _req("score", "/score", {"text_1": "the capital of France", "text_2": DOCS}),
    _req("rerank", "/v1/rerank", {"query": "the capital of France", "documents": DOCS}),
]


def _run(*argv, timeout=600) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false", BLITZ_NO_PROGRESS="1")
    return subprocess.run([sys.executable, "-m", "blitzllm.cli", "run-batch", *argv, *ENGINE],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _write(path, items) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    return str(path)


@pytest.fixture(scope="module")
def answered(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    r = _run("-i", _write(d / "in.jsonl", REQUESTS), "-o", str(d / "out.jsonl"))
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(x) for x in (d / "out.jsonl").read_text().splitlines()], r.stderr


def test_answers_equal_the_engines_in_input_order(answered, smollm2_llm):
    lines, stderr = answered
    by_id = {x["custom_id"]: x for x in lines}
    assert [x["custom_id"] for x in lines] == [q["custom_id"] for q in REQUESTS]
    assert len({x["id"] for x in lines}) == len(lines)
    assert f"{len(REQUESTS)} requests ({len(REQUESTS) - 2} answered, 2 refused)" in stderr
    greedy = SamplingParams(temperature=0, max_tokens=12)
    chat = by_id["chat"]["response"]
    assert chat["status_code"] == 200 and by_id["chat"]["error"] is None
    assert chat["body"]["id"].endswith(chat["request_id"])
    assert chat["body"]["choices"][0]["message"]["content"] == smollm2_llm.chat(CHAT, greedy)[0].text
    want = smollm2_llm.generate(PROMPTS, greedy.clone(max_tokens=10))
    for i, out in enumerate(want):
        body = by_id[f"c{i}"]["response"]["body"]
        assert body["object"] == "text_completion" and body["choices"][0]["text"] == out.text
        assert body["usage"]["prompt_tokens"] == len(out.prompt_token_ids)
    vectors = [d["embedding"] for d in by_id["embed"]["response"]["body"]["data"]]
    for got, out in zip(vectors, smollm2_llm.embed(DOCS)):
        assert got == pytest.approx(out.outputs.embedding, abs=1e-4)
    scores = [o.outputs.score for o in smollm2_llm.score("the capital of France", DOCS)]
    assert [d["score"] for d in by_id["score"]["response"]["body"]["data"]] == pytest.approx(scores, abs=1e-4)
    ranked = by_id["rerank"]["response"]["body"]["results"]
    assert [x["index"] for x in ranked] == sorted(range(2), key=lambda i: -scores[i])


@pytest.mark.parametrize("cid,param", [("bad", "max_tokens"), ("stream", "stream")])
def test_refusals_carry_the_servers_error(answered, cid, param):
    line = next(x for x in answered[0] if x["custom_id"] == cid)
    assert line["response"]["status_code"] == 400 and line["response"]["body"] is None
    assert line["response"]["request_id"]
    err = line["error"]["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]


class _Files(BaseHTTPRequestHandler):
    """GET serves the input; PUT keeps the body (the output's upload)."""
    store: dict = {}

    def do_GET(self):
        data = self.store.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.end_headers()
        self.wfile.write(data or b"")

    def do_PUT(self):
        self.store[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_http_input_and_output(tmp_path, smollm2_llm):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    items = [_req(f"p{i}", "/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0})
             for i, p in enumerate(PROMPTS[:3])]
    _Files.store["/in.jsonl"] = "".join(json.dumps(x) + "\n" for x in items).encode()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    try:
        r = _run("-i", base + "/in.jsonl", "-o", base + "/out.jsonl", "--output-tmp-dir", str(tmp))
    finally:
        srv.shutdown()
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in _Files.store["/out.jsonl"].decode().splitlines()]
    want = smollm2_llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=6))
    assert [x["custom_id"] for x in lines] == ["p0", "p1", "p2"]
    assert [x["response"]["body"]["choices"][0]["text"] for x in lines] == [o.text for o in want]
    assert list(tmp.iterdir()) == []   # the temporary file went once uploaded


@pytest.mark.parametrize("lines,msg", [
    (['{"custom_id": "a", "method": "POST", "url": "/v1/foo", "body": {}}'], "input line 1: url '/v1/foo' is not"),
    (['{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}'], "input line 1: method must be"),
    (['', '{"method": "POST", "url": "/v1/completions", "body": {}}'], "input line 2: custom_id must be"),
    (['{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}'] * 2,
     "input line 2: custom_id 'a' is used twice"),
    (['{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": []}'], "body must be a JSON object"),
    (['{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}, "x": 1}'], "unknown key(s) x"),
    (['[1]'], "input line 1 is not a JSON object (a JSON list)"),
    (['{"custom_id": '], "input line 1 is not a JSON object (Expecting value"),
    ([''], "the input file holds no requests"),
])
def test_a_bad_file_is_one_line_before_loading(tmp_path, capsys, lines, msg):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["run-batch", "-i", str(path), "-o", str(tmp_path / "out.jsonl"), "--model", "preset:no-such"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("blitz: error: ") and "\n" not in err and msg in err, err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("extra,msg", [
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--output-tmp-dir", "/no/such/dir"], "--output-tmp-dir /no/such/dir is not a folder"),
    (["-o", "/no/such/dir/out.jsonl"], "cannot write --output-file /no/such/dir/out.jsonl"),
])
def test_bad_options_are_one_line(tmp_path, capsys, extra, msg):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(REQUESTS[1]) + "\n")
    argv = ["run-batch", "-i", str(path), "-o", str(tmp_path / "out.jsonl"), "--model", "smollm2", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("blitz: error: ") and msg in err, err
    assert main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o")]) == 2
    assert "cannot read --input-file" in capsys.readouterr().err


def test_a_classifier_batch(tmp_path):
    """/classify lines on a tiny random sequence classifier: transformers' probabilities (1e-4),
    and a chat line on it refused with the server's 400 (a classifier does not generate)."""
    from tests.classifiers import LABELS, hf_logits, make_tiny_classifier, tiny_tokenizer
    hf = make_tiny_classifier("qwen3", tmp_path / "cls", 3)
    texts = ["hello", "what is the capital of france ?"]
    items = [_req("k", "/classify", {"input": texts}),
             _req("g", "/v1/completions", {"prompt": "hello", "max_tokens": 2})]
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false", BLITZ_NO_PROGRESS="1")
    r = subprocess.run([sys.executable, "-m", "blitzllm.cli", "run-batch", "-i", _write(tmp_path / "in.jsonl", items),
                        "-o", str(tmp_path / "out.jsonl"), "--model", str(tmp_path / "cls"), "--dtype", "float32",
                        "--max-model-len", "64", "--kv-cache-blocks", "32"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    k, g = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    tok = tiny_tokenizer()
    for d, text in zip(k["response"]["body"]["data"], texts, strict=True):
        want = hf_logits(hf, tok(text).input_ids).softmax(-1)
        assert d["probs"] == pytest.approx(want.tolist(), abs=1e-4) and d["label"] == LABELS[int(want.argmax())]
    assert g["response"]["status_code"] == 400 and g["error"]["error"]["message"]
