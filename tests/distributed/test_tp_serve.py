"""Tensor parallelism through real processes: ``blitz serve --tensor-parallel-size 2``
answers with TP=1's greedy text, stops its worker on SIGTERM, and exits with an error
(failing the request in flight) when its worker is killed; two ``blitz generate``
processes started with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
form one engine, as two hosts would."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from blitzllm import LLM, SamplingParams
from tests.server.conftest import ServerProcess, _tiny_llama, free_port

PROMPT = "The capital of France is"
N = 16
ENGINE = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--kv-cache-blocks", "64"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return _tiny_llama(tmp_path_factory.mktemp("tp-serve-llama"))


@pytest.fixture(scope="module")
def reference(model) -> str:
    """TP=1's greedy completion of PROMPT (no chat template)."""
    llm = LLM(str(model), device="cpu", dtype="float32", kv_cache_blocks=64, max_model_len=512)
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))[0].outputs[0].text


def _children(pid: int) -> list:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _workers(srv) -> list:
    """The server's spawned rank processes."""
    return [p for p in _children(srv.proc.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def _complete(srv, timeout=60) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", timeout=timeout,
                      json={"model": srv.model, "prompt": PROMPT, "max_tokens": N, "temperature": 0,
                            "ignore_eos": True})


def _serve(model, tmp_path) -> ServerProcess:
    srv = ServerProcess(["--model", str(model), "--tensor-parallel-size", "2", *ENGINE], tmp_path / "server.log")
    srv.model = str(model)
    srv.wait_ready()
    return srv


def test_serve_tp2_matches_tp1_and_stops_its_worker(model, reference, tmp_path):
    srv = _serve(model, tmp_path)
    try:
        workers = _workers(srv)
        r = _complete(srv)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference
    finally:
        srv.stop()
    assert srv.proc.returncode == 0, srv.log()
    assert workers and not any(_alive(p) for p in workers)


def test_serve_fails_loudly_when_its_worker_dies(model, tmp_path):
    srv = _serve(model, tmp_path)
    try:
        assert _complete(srv).status_code == 200
        (worker,) = _workers(srv)
        os.kill(worker, signal.SIGKILL)
        t0 = time.monotonic()
        r = _complete(srv, timeout=30)
        assert r.status_code >= 500 and "worker rank 1" in r.text, r.text
        srv.proc.wait(30)
        assert time.monotonic() - t0 < 30
        assert srv.proc.returncode not in (0, None)
        assert "worker rank 1" in srv.log()
    finally:
        srv.stop()


def test_torchrun_environment_forms_one_engine(model, reference, tmp_path):
    """What two hosts run (here both on loopback): the same command on every rank."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), BLITZ_NO_PROGRESS="1", TRANSFORMERS_VERBOSITY="error")
        cmd = [sys.executable, "-m", "blitzllm.cli", "generate", "--model", str(model), "--prompt", PROMPT,
               "--no-chat", "--max-tokens", str(N), "--temperature", "0", "--tensor-parallel-size", "2", *ENGINE]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert reference.startswith(outs[0][0].rstrip("\n")) and outs[0][0].strip(), outs[0]
    assert outs[1][0] == ""  # rank 1 served rank 0's steps and printed nothing
