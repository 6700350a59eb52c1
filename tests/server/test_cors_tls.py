"""``blitz serve``'s web-facing options, vLLM's names: CORS (``--allowed-origins`` and friends;
off by default), HTTPS (``--ssl-keyfile`` / ``--ssl-certfile``, checked before the model loads),
``--root-path`` behind a proxy, and ``/ping`` beside ``/health``. A real server process on a
tiny model, with a certificate from a throwaway CA (``trustme``)."""
from __future__ import annotations

import ssl
import time

import httpx
import pytest

from blitzllm.cli import main
from tests.server.conftest import STARTUP_TIMEOUT, ServerProcess, _tiny_llama

ORIGIN = "http://app.example"


def _trusting(ca_pem: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca_pem)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    import trustme
    d = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    key, chain, ca_pem = d / "key.pem", d / "cert.pem", d / "ca.pem"
    cert.private_key_pem.write_to_path(str(key))
    cert.cert_chain_pems[0].write_to_path(str(chain))
    ca.cert_pem.write_to_path(str(ca_pem))
    folder = _tiny_llama(d / "tiny")
    srv = ServerProcess(["--model", str(folder), "--served-model-name", "tiny", "--max-model-len", "512",
                         "--kv-cache-blocks", "64", "--api-key", "sesame", "--allowed-origins", ORIGIN,
                         "--ssl-keyfile", str(key), "--ssl-certfile", str(chain), "--root-path", "/llm"],
                        d / "server.log", api_key="sesame")
    srv.url = f"https://127.0.0.1:{srv.port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT
    try:
        while True:
            assert srv.proc.poll() is None, srv.log()
            try:
                if httpx.get(srv.url + "/health", verify=_trusting(str(ca_pem)), timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.25)
        yield srv, str(ca_pem)
    finally:
        srv.stop()


def test_https_and_ping(tls_server):
    srv, ca = tls_server
    with httpx.Client(verify=_trusting(ca), timeout=60) as c:
        assert c.get(srv.url + "/ping").status_code == 200 and c.post(srv.url + "/ping").status_code == 200
        r = c.post(srv.url + "/v1/completions", headers=srv.headers(),
                   json={"model": "tiny", "prompt": "Hi", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        # --root-path: the OpenAPI document names the prefix the proxy serves the app under
        assert c.get(srv.url + "/openapi.json").json()["servers"] == [{"url": "/llm"}]
    with pytest.raises(httpx.HTTPError):   # plain HTTP on the TLS port gets no answer
        httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=5).raise_for_status()
    with pytest.raises(httpx.ConnectError):   # a client that does not trust the CA refuses it
        httpx.get(srv.url + "/health", timeout=5)


def test_cors_preflight_and_answers(tls_server):
    srv, ca = tls_server
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    with httpx.Client(verify=_trusting(ca), timeout=60) as c:
        r = c.options(srv.url + "/v1/chat/completions", headers=pre)   # no API key: preflights carry none
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        other = c.options(srv.url + "/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        r = c.post(srv.url + "/v1/chat/completions", headers={**srv.headers(), "Origin": ORIGIN},
                   json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        r = c.post(srv.url + "/v1/chat/completions", headers={"Origin": ORIGIN},   # the key is still required
                   json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


def test_no_cors_by_default(tiny_server):
    r = httpx.options(tiny_server.url + "/v1/chat/completions",
                      headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}, timeout=30)
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(tiny_server.url + "/health", headers={"Origin": ORIGIN}, timeout=30)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("argv,msg", [
    (["--ssl-keyfile", "/no/key.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-keyfile", "/no/key.pem", "--ssl-certfile", "/no/cert.pem"], "--ssl-keyfile /no/key.pem: no such file"),
    (["--ssl-cert-reqs", "2"], "--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile"),
    (["--allowed-origins", '["http://a", 3]'], "--allowed-origins takes values or a JSON list of strings"),
    (["--allowed-origins", "[nope"], "--allowed-origins takes values or a JSON list"),
    (["--allowed-origins", ""], "--allowed-origins needs non-empty values"),
])
def test_bad_web_options_are_one_line(capsys, argv, msg):
    assert main(["serve", "--model", "smollm2", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("blitz: error: ") and "\n" not in err and msg in err, err
