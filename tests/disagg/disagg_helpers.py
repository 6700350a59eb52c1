"""Processes of the disaggregation tests: ``blitz serve`` and ``blitz router`` on free loopback
ports, started together, and readers of their /metrics."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.server.conftest import ServerProcess, _tiny_llama as tiny_llama, free_port  # noqa: F401

STARTUP_TIMEOUT = 240
ENGINE = ["--dtype", "float32", "--weight-dtype", "float32", "--max-model-len", "512", "--kv-cache-blocks", "512", "--seed", "0", "--log-level", "warning"]


def kv(role: str, **extra) -> list:
    import json
    return ["--kv-transfer-config", json.dumps({"kv_role": role, **extra})]


class Proc(ServerProcess):
    """``blitz serve`` (or ``blitz router`` with ``cmd='router'``) in a subprocess, on ``port`` or a
    free one; ``kill`` is a crash, ``start`` again brings it back on the same port."""

    def __init__(self, args: list, log_dir: Path, name: str, cmd: str = "serve", port: int = 0):
        self.args, self.cmd, self.name = list(args), cmd, name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.api_key = None
        self.start()

    def start(self) -> None:
        # (one torch thread each: several engines share the cores, and spinning OpenMP threads of one
        # would starve the others)
        env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false", BLITZ_NO_PROGRESS="1",
                   OMP_NUM_THREADS="1")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "blitzllm.cli", self.cmd, "--port", str(self.port),
                                      *self.args], stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> "Proc":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout}s:\n{self.log()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()

    def labelled_metrics(self) -> dict:
        """{(sample name, sorted labels): value} of /metrics."""
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


def start_all(procs: list) -> list:
    for p in procs:
        p.wait_ready()
    return procs


def settled(*servers, timeout: float = 30.0) -> dict:
    """Wait until every server shows 0 running, 0 waiting, 0 KV usage and no lease; their metrics."""
    deadline = time.monotonic() + timeout
    while True:
        ms = {s.name: s.metrics() for s in servers}
        if all(m["blitz_num_requests_running"] == 0 and m["blitz_num_requests_waiting"] == 0
               and m["blitz_kv_cache_usage_perc"] == 0 and m.get("blitz_kv_leases_held", 0) == 0
               for m in ms.values()):
            return ms
        if time.monotonic() > deadline:
            raise AssertionError(f"not settled after {timeout}s: {ms}")
        time.sleep(0.2)
