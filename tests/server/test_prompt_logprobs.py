"""vLLM's ``prompt_logprobs`` request extension on /v1/completions and /v1/chat/completions, and
``return_tokens_as_token_ids`` (the request field and ``--return-tokens-as-token-ids``).

On SmolLM2 in float32 (the ``smol_f32_server``), every prompt logprob equals transformers'
log-softmax of the same weights' logits over the same prompt ids (within 1e-3), and every rank the
rank those logits give: completions (text and token-id prompts, several prompts, n > 1, with echo),
chat (the ids are the rendered template's, as /tokenize renders the same messages), a prompt the
prefix cache holds. A stream refuses them (but 0), bad values are 400s naming the field, and the
answers validate against the OpenAPI response models."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from blitzllm.server import protocol as P
from conftest import ServerProcess, running
from server_helpers import check_error

TOL = 1e-3
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
TEXTS = ["The capital of France is Paris, and the capital of Germany is Berlin.",
         "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def tok():
    from blitzllm.loader.source import smollm2_path
    from blitzllm.loader.tokenizer import load_gguf_tokenizer
    return load_gguf_tokenizer(smollm2_path())


@pytest.fixture(scope="module")
def ref(smollm2_hf):
    """ids -> [len(ids), V]: row p is transformers' log p(. | ids[:p + 1])."""
    cache = {}

    def lp(ids):
        key = tuple(ids)
        if key not in cache:
            with torch.no_grad():
                cache[key] = smollm2_hf(torch.tensor([list(ids)])).logits[0].float().log_softmax(-1)
        return cache[key]
    return lp


@pytest.fixture(scope="module")
def ids_server(tmp_path_factory):
    """SmolLM2 with ``--return-tokens-as-token-ids``."""
    srv = ServerProcess(["--model", "smollm2", "--max-model-len", "512", "--kv-cache-blocks", "64",
                         "--return-tokens-as-token-ids"], tmp_path_factory.mktemp("ids") / "server.log")
    yield from running(srv)


def tokenize(srv, **body) -> list:
    r = httpx.post(srv.url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def post(srv, path, body) -> dict:
    r = httpx.post(srv.url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def check_prompt_logprobs(plp, ids, ref_lp, k, tok) -> None:
    """vLLM's form: null, then per token {str(id): {logprob, rank, decoded_token}}: the prompt
    token first, then the top k (ranks 1..k, the token's own entry among them where it is one).
    Logprobs within TOL of transformers'; ranks as its logits rank them (exactly, but where another
    entry is within TOL of the token's, which may order either way)."""
    assert isinstance(plp, list) and len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        entry, t, row = plp[p], ids[p], ref_lp[p - 1]
        assert list(entry)[0] == str(t), (p, entry)
        assert len(entry) in (k, k + 1) if k else len(entry) == 1, (p, entry)
        ordered = row.sort(descending=True).values
        for key, v in entry.items():
            tid = int(key)
            assert set(v) == {"logprob", "rank", "decoded_token"}, v
            assert abs(v["logprob"] - row[tid].item()) < TOL, (p, tid, v, row[tid].item())
            assert v["decoded_token"] == tok.decode([tid]), (p, tid, v)
            lo = int((row > row[tid] + TOL).sum()) + 1     # the rank it can have, near ties aside
            hi = int((row >= row[tid] - TOL).sum())
            assert lo <= v["rank"] <= hi, (p, tid, v, lo, hi)
            assert abs(ordered[v["rank"] - 1].item() - v["logprob"]) < TOL, (p, tid, v)
        ranks = sorted(v["rank"] for key, v in entry.items() if key != str(t) or len(entry) == k)
        assert ranks == list(range(1, k + 1)), (p, entry)


# ---- completions ------------------------------------------------------------------------------
def test_completions_prompt_logprobs_match_transformers(smol_f32_server, ref, tok):
    """Several prompts (text and token ids), n = 2: each choice carries its prompt's list, equal to
    transformers' log-softmax and ranks; the answer is the documented model."""
    srv = smol_f32_server
    ids = [tokenize(srv, prompt=t) for t in TEXTS]
    body = {"prompt": [TEXTS[0], TEXTS[1]], "prompt_logprobs": 3, "n": 2, "max_tokens": 3, "temperature": 0.8,
            "seed": 1}
    for prompts in ([TEXTS[0], TEXTS[1]], ids):
        out = post(srv, CMPL, {**body, "prompt": prompts})
        P.CompletionResponse.model_validate(out)
        assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
        for c in out["choices"]:
            j = c["index"] // 2
            check_prompt_logprobs(c["prompt_logprobs"], ids[j], ref(ids[j]), 3, tok)
        assert out["choices"][0]["prompt_logprobs"] == out["choices"][1]["prompt_logprobs"]
        assert out["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    # 0: the prompt token's own entry alone; without the field, no prompt_logprobs at all
    out = post(srv, CMPL, {"prompt": TEXTS[1], "prompt_logprobs": 0, "max_tokens": 2})
    check_prompt_logprobs(out["choices"][0]["prompt_logprobs"], ids[1], ref(ids[1]), 0, tok)
    out = post(srv, CMPL, {"prompt": TEXTS[1], "max_tokens": 2})
    assert "prompt_logprobs" not in out["choices"][0]


def test_completions_prompt_logprobs_beside_echo(smol_f32_server, ref, tok):
    """echo + logprobs (the legacy prompt scoring) and prompt_logprobs in one request, each with
    its own top-N; max_tokens 0 scores the prompt alone."""
    srv = smol_f32_server
    ids = tokenize(srv, prompt=TEXTS[0])
    for k_echo, k_plp in ((1, 4), (5, 2)):
        for max_tokens in (0, 2):
            out = post(srv, CMPL, {"prompt": TEXTS[0], "echo": True, "logprobs": k_echo, "prompt_logprobs": k_plp,
                                   "max_tokens": max_tokens, "temperature": 0})
            P.CompletionResponse.model_validate(out)
            c = out["choices"][0]
            check_prompt_logprobs(c["prompt_logprobs"], ids, ref(ids), k_plp, tok)
            lp = c["logprobs"]
            assert len(lp["tokens"]) == len(ids) + max_tokens and lp["token_logprobs"][0] is None
            for p in range(1, len(ids)):
                assert abs(lp["token_logprobs"][p] - c["prompt_logprobs"][p][str(ids[p])]["logprob"]) < 1e-6
                assert len(lp["top_logprobs"][p]) in (k_echo, k_echo + 1)


def test_prompt_logprobs_with_the_prefix_cache(smol_f32_server, ref, tok):
    """A prompt the prefix cache holds: prompt_logprobs still cover every token (the engine scores
    every prompt position of such a request, so it reads none of them from the cache)."""
    srv = smol_f32_server
    text = " ".join(TEXTS * 4)
    ids = tokenize(srv, prompt=text)
    assert len(ids) > 64

    def hits():
        m = srv.metrics()
        return m.get("blitz_prefix_cache_hit_tokens_total", m.get("blitz_prefix_cache_hit_tokens"))

    post(srv, CMPL, {"prompt": text, "max_tokens": 1})
    before = hits()
    post(srv, CMPL, {"prompt": text, "max_tokens": 1})
    assert hits() > before   # (it is cached)
    before = hits()
    first = post(srv, CMPL, {"prompt": text, "max_tokens": 1, "prompt_logprobs": 2})["choices"][0]["prompt_logprobs"]
    assert hits() == before
    check_prompt_logprobs(first, ids, ref(ids), 2, tok)
    again = post(srv, CMPL, {"prompt": text, "max_tokens": 1, "prompt_logprobs": 2})["choices"][0]["prompt_logprobs"]
    assert again == first


# ---- chat -------------------------------------------------------------------------------------
def test_chat_prompt_logprobs_are_the_rendered_prompts(smol_f32_server, ref, tok):
    """The top-level prompt_logprobs score the chat template's rendered prompt: the ids /tokenize
    gives for the same messages; n = 2 shares one list."""
    srv = smol_f32_server
    ids = tokenize(srv, messages=MESSAGES)
    out = post(srv, CHAT, {"messages": MESSAGES, "prompt_logprobs": 2, "n": 2, "max_tokens": 3, "logprobs": True,
                           "top_logprobs": 1, "temperature": 0.7, "seed": 3})
    P.ChatCompletionResponse.model_validate(out)
    assert out["usage"]["prompt_tokens"] == len(ids) and len(out["choices"]) == 2
    assert [int(next(iter(e))) for e in out["prompt_logprobs"][1:]] == ids[1:]
    check_prompt_logprobs(out["prompt_logprobs"], ids, ref(ids), 2, tok)
    assert all("prompt_logprobs" not in c for c in out["choices"])
    # continue_final_message: the rendered prompt ends inside the assistant's turn
    cont = MESSAGES + [{"role": "assistant", "content": "Red, green"}]
    ids = tokenize(srv, messages=cont, add_generation_prompt=False, continue_final_message=True)
    out = post(srv, CHAT, {"messages": cont, "prompt_logprobs": 1, "max_tokens": 2, "add_generation_prompt": False,
                           "continue_final_message": True})
    check_prompt_logprobs(out["prompt_logprobs"], ids, ref(ids), 1, tok)
    assert "prompt_logprobs" not in post(srv, CHAT, {"messages": MESSAGES, "max_tokens": 2})


# ---- streams and bad values -------------------------------------------------------------------
def _events(srv, path, body) -> list:
    with httpx.stream("POST", srv.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_streams_and_bad_values(smol_f32_server):
    """A stream has no place for them: prompt_logprobs > 0 with stream is a 400 (0 streams as
    without it), as vLLM; a value outside [0, 20] or not an integer is a 400 naming the field."""
    srv = smol_f32_server
    bodies = {CMPL: {"prompt": TEXTS[0], "max_tokens": 2}, CHAT: {"messages": MESSAGES, "max_tokens": 2}}
    for path, body in bodies.items():
        check_error(httpx.post(srv.url + path, json={**body, "stream": True, "prompt_logprobs": 1}), 400,
                    "prompt_logprobs")
        events = _events(srv, path, {**body, "stream": True, "prompt_logprobs": 0})
        assert events and not any("prompt_logprobs" in json.dumps(ev) for ev in events)
        for bad in (-1, 21, "3", 2.5, True, [1], {"k": 1}):
            check_error(httpx.post(srv.url + path, json={**body, "prompt_logprobs": bad}), 400, "prompt_logprobs")
        for bad in ("yes", 1, [True]):
            check_error(httpx.post(srv.url + path, json={**body, "return_tokens_as_token_ids": bad}), 400,
                        "return_tokens_as_token_ids")
        assert httpx.post(srv.url + path, json={**body, "prompt_logprobs": 20}, timeout=120).status_code == 200
    # (other fields' checks still come first where they did)
    check_error(httpx.post(srv.url + CMPL, json={"prompt": TEXTS[0], "max_tokens": 0, "prompt_logprobs": 1}), 400,
                "max_tokens")


# ---- return_tokens_as_token_ids ---------------------------------------------------------------
def _as_id(t: int) -> str:
    return f"token_id:{t}"


def test_return_tokens_as_token_ids_per_request(smol_f32_server, tok):
    """The request field: logprobs' tokens (and top_logprobs' keys, and chat's bytes) as
    'token_id:<id>'; completions' text offsets stay the text's; prompt_logprobs' decoded_token
    stays the text (as vLLM's)."""
    srv = smol_f32_server
    ids = tokenize(srv, prompt=TEXTS[0])
    plain = post(srv, CMPL, {"prompt": TEXTS[0], "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0})
    out = post(srv, CMPL, {"prompt": TEXTS[0], "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0,
                           "return_tokens_as_token_ids": True, "prompt_logprobs": 1})
    P.CompletionResponse.model_validate(out)
    c, c0 = out["choices"][0], plain["choices"][0]
    assert c["text"] == c0["text"]
    lp, lp0 = c["logprobs"], c0["logprobs"]
    assert lp["tokens"][:len(ids)] == [_as_id(t) for t in ids]
    assert len(lp["tokens"]) == len(ids) + 3 and all(t.startswith("token_id:") for t in lp["tokens"])
    assert [tok.decode([int(t[9:])]) for t in lp["tokens"]] == lp0["tokens"]
    assert lp["text_offset"] == lp0["text_offset"] and lp["token_logprobs"] == lp0["token_logprobs"]
    for top, top0 in zip(lp["top_logprobs"], lp0["top_logprobs"]):
        if top is None:
            assert top0 is None
            continue
        assert all(k.startswith("token_id:") for k in top)
        assert sorted(top.values()) == sorted(top0.values())
        assert {tok.decode([int(k[9:])]) for k in top} == set(top0)
    for p, e in enumerate(c["prompt_logprobs"][1:], 1):
        assert e[str(ids[p])]["decoded_token"] == tok.decode([ids[p]])
    # chat: content tokens, bytes and top tokens
    body = {"messages": MESSAGES, "max_tokens": 4, "logprobs": True, "top_logprobs": 2, "temperature": 0}
    plain = post(srv, CHAT, body)["choices"][0]["logprobs"]["content"]
    out = post(srv, CHAT, {**body, "return_tokens_as_token_ids": True})
    P.ChatCompletionResponse.model_validate(out)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] == len(plain)
    for e, e0 in zip(content, plain):
        assert e["token"].startswith("token_id:") and e["bytes"] == list(e["token"].encode())
        assert tok.decode([int(e["token"][9:])]) == e0["token"] and e["logprob"] == e0["logprob"]
        assert [tok.decode([int(t["token"][9:])]) for t in e["top_logprobs"]] == \
            [t["token"] for t in e0["top_logprobs"]]
        assert all(t["bytes"] == list(t["token"].encode()) for t in e["top_logprobs"])


def test_return_tokens_as_token_ids_server_flag(ids_server):
    """--return-tokens-as-token-ids: every request's logprobs tokens as ids, streams too, unless
    the request says return_tokens_as_token_ids false."""
    srv = ids_server
    body = {"messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 1, "temperature": 0}
    content = post(srv, CHAT, body)["choices"][0]["logprobs"]["content"]
    assert content and all(e["token"].startswith("token_id:") for e in content)
    content = post(srv, CHAT, {**body, "return_tokens_as_token_ids": False})["choices"][0]["logprobs"]["content"]
    assert content and not any(e["token"].startswith("token_id:") for e in content)
    events = _events(srv, CHAT, {**body, "stream": True})
    streamed = [e for ev in events for ch in ev["choices"] for e in (ch["logprobs"] or {}).get("content") or []]
    assert streamed and all(e["token"].startswith("token_id:") for e in streamed)
    cbody = {"prompt": TEXTS[1], "max_tokens": 3, "logprobs": 1, "temperature": 0}
    lp = post(srv, CMPL, cbody)["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
    lp = post(srv, CMPL, {**cbody, "return_tokens_as_token_ids": False})["choices"][0]["logprobs"]
    assert not any(t.startswith("token_id:") for t in lp["tokens"])
    events = _events(srv, CMPL, {**cbody, "stream": True, "echo": True})
    tokens = [t for ev in events for ch in ev["choices"] for t in (ch["logprobs"] or {}).get("tokens", [])]
    assert len(tokens) == len(tokenize(srv, prompt=TEXTS[1])) + 3
    assert all(t.startswith("token_id:") for t in tokens)


# ---- ties, without a server -------------------------------------------------------------------
def test_ranks_and_top_entries_with_ties():
    """The engine's rank counts every entry whose logprob is >= the token's (a tie ranks it
    after its equals, as vLLM's count); the answer's top entries are ranked 1..N by place, the
    prompt token's entry taking its place where it is among them."""
    from blitzllm import SamplingParams
    from blitzllm.engine.request import Request, score_prompt
    from blitzllm.server.chat import prompt_logprobs_body

    class S:
        @staticmethod
        def tok_str(t):
            return f"<{t}>"

    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 2.0],     # scores token 2: tied first
                           [5.0, 1.0, 1.0, 1.0, 4.0],     # token 3: tied with two others past the top 2
                           [0.0, 0.0, 0.0, 0.0, 9.0]])    # token 4: first
    for k in (0, 2):
        req = Request("r", [0, 2, 3, 4], SamplingParams(prompt_logprobs=k), seed=0, arrival=0)
        req.prompt_logprobs, req.prompt_ranks = [], []
        score_prompt(req, logits, 0)
        assert req.prompt_ranks == [2, 5, 1]
        lp = logits.log_softmax(-1)
        body = prompt_logprobs_body(S, req.prompt_token_ids, [None] + req.prompt_logprobs, [None] + req.prompt_ranks,
                                    k, k)
        assert body[0] is None and [list(e)[0] for e in body[1:]] == ["2", "3", "4"]
        for e, row in zip(body[1:], lp):
            for key, v in e.items():
                assert abs(v["logprob"] - row[int(key)].item()) < 1e-6 and v["decoded_token"] == f"<{key}>"
        if k == 0:
            assert [len(e) for e in body[1:]] == [1, 1, 1] and [e[next(iter(e))]["rank"] for e in body[1:]] == [2, 5, 1]
        else:
            assert {key: v["rank"] for key, v in body[1].items()} in ({"2": 1, "1": 2}, {"2": 2, "1": 1})
            assert {key: v["rank"] for key, v in body[2].items()} == {"3": 5, "0": 1, "4": 2}
            assert body[3]["4"]["rank"] == 1 and sorted(v["rank"] for v in body[3].values()) == [1, 2]
