"""Fixtures: real ``blitz serve`` processes on free loopback ports, one per model, shared by
the whole server suite (the default SmolLM2 model, and a tiny random Llama for the limits
that need odd server settings), and per module a tiny thinking model (reasoning and tools)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

STARTUP_TIMEOUT = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list, log_path: Path, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        self.health_codes: list = []   # every /health status seen while starting
        self.loading_response = None   # a completion request sent while the model loads
        env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false", BLITZ_NO_PROGRESS="1")
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "blitzllm.cli", "serve", "--port", str(self.port),
                                      "--log-level", "warning", *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"blitz serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                code = httpx.get(self.url + "/health", timeout=5).status_code
                self.health_codes.append(code)
                if code == 200:
                    return
                if self.loading_response is None:
                    self.loading_response = httpx.post(self.url + "/v1/completions", headers=self.headers(),
                                                       json={"prompt": "Hi", "max_tokens": 1}, timeout=5)
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"blitz serve not ready after {STARTUP_TIMEOUT}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict:
        """{sample name: value} of /metrics (labels dropped; one model per server)."""
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if "le" in s.labels or "finished_reason" in s.labels or "status" in s.labels:
                    continue
                out[s.name] = s.value
        return out


def running(srv: ServerProcess):
    """A fixture's body: ``srv`` once it is ready, stopped however the tests end."""
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def smol_server(tmp_path_factory):
    """The default model, as users run it."""
    srv = ServerProcess(["--model", "smollm2", "--max-model-len", "1024", "--seed", "0"],
                        tmp_path_factory.mktemp("smol") / "server.log")
    yield from running(srv)
    assert srv.proc.returncode == 0, f"SIGTERM should stop the server cleanly:\n{srv.log()}"


@pytest.fixture(scope="session")
def smol_f32_server(tmp_path_factory):
    """The default model with ``--dtype float32`` (the GGUF dequantized, as transformers and the
    ``smollm2_llm`` fixture run it): for answers compared with theirs."""
    srv = ServerProcess(["--model", "smollm2", "--dtype", "float32", "--max-model-len", "1024", "--seed", "0"],
                        tmp_path_factory.mktemp("smol-f32") / "server.log")
    yield from running(srv)


def _tiny_llama(folder: Path, special_tokens: tuple = ()) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer (loads in a second or two), and
    ``special_tokens`` added to it."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from blitzllm.loader.source import smollm2_path
    from blitzllm.loader.tokenizer import load_gguf_tokenizer
    tok = load_gguf_tokenizer(smollm2_path())
    if special_tokens:
        tok.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    """A tiny random model behind an API key, one running sequence at most, a waiting bound of
    one and a small body limit: the server limits, cheaply. Auto tool choice is on (with
    SmolLM2's chat template, which renders no tools)."""
    folder = _tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    srv = ServerProcess(["--model", str(folder), "--served-model-name", "tiny", "--api-key", "sesame",
                         "--max-num-seqs", "1", "--max-waiting-requests", "1", "--max-request-bytes", "65536",
                         "--max-model-len", "1024", "--kv-cache-blocks", "128",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                        tmp_path_factory.mktemp("tiny") / "server.log", api_key="sesame")
    yield from running(srv)


def with_chat_template(folder: Path, template: str) -> Path:
    """The model folder's chat template replaced by ``template``."""
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    for extra in ("chat_template.jinja", "chat_template.json"):  # (newer transformers keep it apart)
        (folder / extra).unlink(missing_ok=True)
    return folder


THINKING_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{%- endfor %}"
    "<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{%- endif %}{%- endif %}")


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    """A tiny random model whose chat template opens ``<think>`` unless ``chat_template_kwargs`` says
    ``enable_thinking: false``, with the qwen3 reasoning parser and hermes tool calls (its template
    renders tools and earlier calls)."""
    folder = _tiny_llama(tmp_path_factory.mktemp("tiny-thinking"))
    with_chat_template(folder, THINKING_TEMPLATE)
    srv = ServerProcess(["--model", str(folder), "--served-model-name", "think", "--reasoning-parser", "qwen3",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--max-model-len", "512", "--kv-cache-blocks", "64"],
                        tmp_path_factory.mktemp("think") / "server.log")
    yield from running(srv)
