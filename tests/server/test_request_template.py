"""A request's own ``chat_template`` (vLLM's field): rendered where the server runs with
``--trust-request-chat-template`` (chat completions, ``/tokenize``, embeddings' ``messages``),
as transformers renders that template; a 400 naming it without the flag (tests/server/
test_errors.py) or when it is empty or fails on the messages; the server keeps serving."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import ServerProcess, _tiny_llama, running
from tests.server.server_helpers import check_error, wait_idle

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def trusting(tmp_path_factory):
    folder = _tiny_llama(tmp_path_factory.mktemp("tiny-llama-tpl"))
    srv = ServerProcess(["--model", str(folder), "--served-model-name", "tiny", "--trust-request-chat-template",
                         "--max-model-len", "512", "--kv-cache-blocks", "64"],
                        tmp_path_factory.mktemp("tiny-tpl") / "server.log")
    for s in running(srv):
        yield s, folder


def _want(folder, add_generation_prompt: bool) -> list:
    """transformers' rendering of MSGS through TEMPLATE, tokenized as the rendered text."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    text = tok.apply_chat_template(MSGS, chat_template=TEMPLATE, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)
    assert text.startswith("<system>Be brief.<user>Hi there")
    return tok(text, add_special_tokens=False).input_ids


def test_a_trusted_request_template_is_rendered(trusting):
    srv, folder = trusting
    want = _want(folder, True)
    post = lambda path, body: httpx.post(srv.url + path, json={"model": "tiny", **body}, timeout=60)  # noqa: E731
    r = post("/tokenize", {"messages": MSGS, "chat_template": TEMPLATE})
    assert r.status_code == 200 and r.json()["tokens"] == want
    own = post("/tokenize", {"messages": MSGS}).json()["tokens"]
    assert own != want   # (the model's own template renders otherwise)
    r = post("/v1/chat/completions", {"messages": MSGS, "chat_template": TEMPLATE, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want)
    r = post("/v1/embeddings", {"messages": MSGS, "chat_template": TEMPLATE})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(_want(folder, False))
    wait_idle(srv)


@pytest.mark.parametrize("template,param", [("  ", "chat_template"), ("{{ raise_exception('no system role') }}",
                                                                        "messages")])
def test_a_bad_request_template_is_a_400(trusting, template, param):
    srv, _ = trusting
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": MSGS, "chat_template": template, "max_tokens": 2})
    check_error(r, 400, param)
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200
