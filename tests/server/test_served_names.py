"""Several ``--served-model-name``s (vLLM's): /v1/models lists each, a request may name any,
the answer names the first; the --model path is still accepted; another name is a 404. Bad
names are one error line before the model loads."""
from __future__ import annotations

import httpx
import pytest

from blitzllm.cli import main
from tests.server.conftest import ServerProcess, _tiny_llama, running
from tests.server.server_helpers import check_error, wait_idle


@pytest.fixture(scope="module")
def named(tmp_path_factory):
    folder = _tiny_llama(tmp_path_factory.mktemp("tiny-llama-names"))
    srv = ServerProcess(["--model", str(folder), "--served-model-name", "tiny", "tiny-v2", "team/tiny",
                         "--max-model-len", "512", "--kv-cache-blocks", "64"],
                        tmp_path_factory.mktemp("tiny-names") / "server.log")
    for s in running(srv):
        yield s, folder


def test_every_name_is_listed_and_served(named):
    srv, folder = named
    ids = [c["id"] for c in httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]]
    assert ids == ["tiny", "tiny-v2", "team/tiny"]
    assert httpx.get(srv.url + "/v1/models/team/tiny", timeout=10).json()["id"] == "team/tiny"
    for name in ("tiny", "tiny-v2", "team/tiny", str(folder)):
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"model": name, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == "tiny"
    check_error(httpx.post(srv.url + "/v1/completions", timeout=60, json={"model": "other", "prompt": "Hi"}),
                404, "model")
    wait_idle(srv)


@pytest.mark.parametrize("names", [["a", "a"], ["a", " "]])
def test_bad_names_are_one_line(capsys, names):
    assert main(["serve", "--model", "smollm2", "--served-model-name", *names]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "blitz: error: --served-model-name takes distinct, non-empty names", err
