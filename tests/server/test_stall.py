"""Issue 36, finding 1 / acceptance 2: one client's large request must not stall the others. While a
stream runs, large requests arrive (from another process, so this one only measures); the stream's
largest gap between chunks stays under 0.5 s and /health answers within 0.2 s throughout.

The load's process runs at nice 10: on this 2-core machine the clients share the server's cores,
and their own CPU use must not be what slows it (on a real deployment they are elsewhere). Other
tenants of a shared test machine can slow any step, so a measurement is tried up to three times
and every attempt is reported."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx

MAX_GAP_S = 0.5
MAX_HEALTH_S = 0.2
ATTEMPTS = 3

# The load: the requests of sys.argv[2] ([[path, body kind, characters], ...]) sent at once;
# prints the start / end times (time.time()) and per request [path, status, seconds, error code
# or token count].
LOAD = r"""
import json, os, sys, threading, time
import httpx
os.nice(10)
url, spec = sys.argv[1], json.loads(sys.argv[2])
def text(i, size):
    para = f"Chapter {i}. The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 20 + "\n"
    return (para * (size // len(para) + 1))[:size]
bodies = []
for i, (path, kind, size) in enumerate(spec):
    t = text(i, size)
    body = {"chat": {"messages": [{"role": "user", "content": t}], "max_tokens": 4},
            "prompt": {"prompt": t, "max_tokens": 4}}[kind]
    bodies.append((path, json.dumps(body).encode()))
out = [None] * len(bodies)
def send(k):
    path, body = bodies[k]
    t0 = time.time()
    with httpx.Client(timeout=600) as c:
        r = c.post(url + path, content=body, headers={"content-type": "application/json"})
    out[k] = [path, r.status_code, time.time() - t0, r.content]
threads = [threading.Thread(target=send, args=(k,)) for k in range(len(bodies))]
start = time.time()
for t in threads:
    t.start()
for t in threads:
    t.join()
end = time.time()
res = []
for path, status, secs, content in out:
    body = json.loads(content)
    res.append([path, status, secs, body["error"]["code"] if status != 200 else body["count"]])
print(json.dumps({"start": start, "end": end, "results": res}))
"""


def measure(url: str, spec: list) -> tuple:
    """Runs the load of ``spec`` while a stream runs and /health is polled; returns (results, the
    stream's gaps between chunks in the load's window, the /health latencies in it, a report)."""
    stop = threading.Event()
    chunks: list = []     # (stream number, time.time()) of every SSE chunk
    health: list = []     # (sent at, seconds to answer)
    failures: list = []

    def streamer():
        body = {"prompt": "Tell me a long story.", "max_tokens": 900, "ignore_eos": True, "stream": True}
        n = 0
        try:
            with httpx.Client(timeout=60) as c:
                while not stop.is_set():
                    with c.stream("POST", url + "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        for line in r.iter_lines():
                            if line.startswith("data: "):
                                chunks.append((n, time.time()))
                            if stop.is_set():
                                break
                    n += 1
        except Exception as e:  # noqa: BLE001 - reported by the caller
            failures.append(repr(e))

    def poller():
        try:
            with httpx.Client(timeout=30) as c:
                while not stop.is_set():
                    t0 = time.time()
                    assert c.get(url + "/health").status_code == 200
                    health.append((t0, time.time() - t0))
                    time.sleep(0.05)
        except Exception as e:  # noqa: BLE001 - reported by the caller
            failures.append(repr(e))

    threads = [threading.Thread(target=streamer, daemon=True), threading.Thread(target=poller, daemon=True)]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while len(chunks) < 5 and time.time() < deadline:
        time.sleep(0.05)
    assert len(chunks) >= 5, failures
    time.sleep(0.5)
    try:
        load = subprocess.run([sys.executable, "-c", LOAD, url, json.dumps(spec)], capture_output=True, text=True,
                              timeout=300)
        time.sleep(0.3)  # (the gap that spans the load's end counts too)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert load.returncode == 0, load.stderr[-3000:]
    assert not failures, failures
    rep = json.loads(load.stdout)
    start, end = rep["start"], rep["end"]
    gaps = [t - t_prev for (s_prev, t_prev), (s, t) in zip(chunks, chunks[1:])
            if s == s_prev and t >= start and t_prev <= end]
    in_window = [h for t0, h in health if start - 0.1 <= t0 <= end]
    report = (f"load {end - start:.1f}s; {len(gaps)} stream gaps, largest {max(gaps, default=0):.3f}s; "
              f"{len(in_window)} /health probes, slowest {max(in_window, default=0):.3f}s")
    return rep["results"], gaps, in_window, report


def check_no_stall(url: str, spec: list, check_results) -> None:
    reports = []
    for _ in range(ATTEMPTS):
        results, gaps, health, report = measure(url, spec)
        check_results(results)
        reports.append(report)
        print(report)
        assert len(gaps) >= 5 and len(health) >= 5, report
        if max(gaps) < MAX_GAP_S and max(health) < MAX_HEALTH_S:
            return
    raise AssertionError(f"stream gaps over {MAX_GAP_S}s or /health over {MAX_HEALTH_S}s in every attempt: "
                         + " | ".join(reports))


def test_large_requests_do_not_stall_streams_or_health(smol_server):
    """Acceptance 2: four 7 MB chat requests and four 7 MB /tokenize requests. Each is refused as too
    long for the context by its characters, before it is tokenized; none of them is done on the
    event loop."""
    spec = [["/v1/chat/completions", "chat", 7_000_000], ["/tokenize", "prompt", 7_000_000]] * 4

    def check(results):
        for path, status, secs, what in results:
            assert (status, what) == (400, "context_length_exceeded"), (path, status, what)

    check_no_stall(smol_server.url, spec, check)


def test_long_prompts_tokenized_off_the_loop(smol_server):
    """Texts under the character bound but long (the bulk pool's tokenization, at a lowered
    priority): /tokenize answers their counts, a completion of one is refused by its token count,
    and the stream and /health keep their pace meanwhile."""
    spec = [["/tokenize", "prompt", 60_000]] * 12 + [["/v1/completions", "prompt", 60_000]] * 4
    want = len(httpx.post(smol_server.url + "/tokenize", json={"prompt": "x"}).json()["tokens"])
    assert want == 1

    def check(results):
        counts = set()
        for path, status, secs, what in results:
            if path == "/tokenize":
                assert status == 200 and what > 10_000, (path, status, what)
                counts.add(what)
            else:
                assert (status, what) == (400, "context_length_exceeded"), (path, status, what)
        assert len(counts) <= 10   # (the texts differ only in their chapter number)

    check_no_stall(smol_server.url, spec, check)


# ---- the pieces, without a server ----------------------------------------------------------
def _serving(tok, max_model_len=1024):
    from types import SimpleNamespace
    from blitzllm.server.serving import Serving
    s = Serving(None, "m")
    s.setup(SimpleNamespace(sampling_defaults={}, max_model_len=max_model_len, model_config=SimpleNamespace(vocab_size=len(tok), is_classifier=False, labels=())), tok)
    return s


def test_character_bound_is_sound():
    """No text of more than max_model_len * max_token_chars characters fits in max_model_len
    tokens: every token covers at most max_token_chars characters (SmolLM2: byte-level BPE)."""
    import random
    from blitzllm.loader.source import smollm2_path
    from blitzllm.loader.tokenizer import dummy_tokenizer, load_gguf_tokenizer
    from blitzllm.server.serving import max_token_chars
    tok = load_gguf_tokenizer(smollm2_path())
    per = max_token_chars(tok)
    vocab = tok.get_vocab()
    assert per == max(len(t) for t in vocab) and per >= 16
    rng = random.Random(0)
    pieces = [t for t in vocab if len(t) >= per - 4] + ["é", "日本", "\U0001F600", " ", "\n", "<|im_start|>", "#" * 200]
    for _ in range(20):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 400)))
        n = len(tok.encode(text, add_special_tokens=False))
        assert n * per >= len(text), (n, len(text))
    s = _serving(tok, 64)
    assert s.max_prompt_chars == 64 * per
    # a word-level model (unknown text becomes <unk>) gets no bound: the body limit alone holds
    assert max_token_chars(dummy_tokenizer(512, None)) is None
    s.close()


def test_worker_encode_and_decode_equal_the_tokenizer():
    """The workers' Rust batch calls (GIL released) give the tokenizer's own encode / decode."""
    from blitzllm.loader.source import smollm2_path
    from blitzllm.loader.tokenizer import load_gguf_tokenizer
    from blitzllm.server.errors import APIError
    from blitzllm.server.protocol import DetokenizeRequest
    from blitzllm.server.serving import json_with_ids
    from blitzllm.server.tokens import detokenize_request
    tok = load_gguf_tokenizer(smollm2_path())
    s = _serving(tok, 1024)
    texts = ["Hello world", "<|im_start|>user\nHi<|im_end|>\n", " leading  spaces\t", "é日本\U0001F600" * 50,
             "The quick brown fox. " * 3000]
    for text in texts:
        for special in (True, False):
            assert s.encode(text, special) == tok.encode(text, add_special_tokens=special)
    try:
        s.encode("The quick brown fox. " * 3000, True, "prompt")
        raise AssertionError("a prompt past max_model_len tokens must be refused")
    except APIError as e:
        assert e.status == 400 and e.param == "prompt" and e.code == "context_length_exceeded"
    ids = tok.encode("The quick brown fox, é日本. " * 2000)
    assert len(ids) > 4096   # (the long path)
    assert detokenize_request(s, DetokenizeRequest(tokens=ids))["prompt"] == tok.decode(ids)
    assert detokenize_request(s, DetokenizeRequest(tokens=ids[:10]))["prompt"] == tok.decode(ids[:10])
    assert json.loads(json_with_ids({"count": 3, "x": "y"}, "tokens", list(range(70_000)))) == \
        {"count": 3, "x": "y", "tokens": list(range(70_000))}
    assert json.loads(json_with_ids({"count": 0}, "tokens", [])) == {"count": 0, "tokens": []}
    s.close()
