"""``blitz bench serve`` against a running ``blitz serve``: runs, reports, writes its JSON."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from blitzllm.bench.serve import find_mt_bench


def bench(srv, tmp_path, *args) -> tuple:
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "blitzllm.cli", "bench", "serve", "--base-url", srv.url, "--save-json", str(out),
           "--no-progress", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout, json.loads(out.read_text())


def test_bench_serve_mt_bench(smol_server, tmp_path):
    stdout, doc = bench(smol_server, tmp_path, "--dataset", "mt-bench", "--num-prompts", "3", "--concurrency", "3",
                        "--output-len", "4")
    for line in ("Successful requests:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                 "Median TTFT (ms):", "P99 ITL (ms):", "Mean TPOT (ms):", "Median E2EL (ms):"):
        assert line in stdout
    assert doc["successful_requests"] == 3 and doc["failed_requests"] == 0
    assert doc["total_output_tokens"] == 12            # ignore_eos: exactly --output-len each
    assert doc["total_input_tokens"] > 0
    assert doc["output_throughput"] > 0 and doc["ttft_ms"]["median"] > 0
    assert len(doc["ttfts_s"]) == 3 and all(len(x) >= 1 for x in doc["itls_s"])
    assert doc["config"]["model"] == "smollm2"


def test_bench_serve_random(smol_server, tmp_path):
    """The random dataset (no matplotlib needed: the plot has its own test)."""
    _, doc = bench(smol_server, tmp_path, "--dataset", "random", "--input-len", "12", "--output-len", "3",
                   "--num-prompts", "4", "--concurrency", "2", "--request-rate", "50")
    assert doc["successful_requests"] == 4 and doc["failed_requests"] == 0
    assert doc["total_input_tokens"] == 4 * 12 and doc["total_output_tokens"] == 4 * 3
    assert len(doc["ttfts_s"]) == 4


def test_bench_serve_plot(smol_server, tmp_path):
    """--plot writes the TTFT / ITL histograms (matplotlib: in the test extras)."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "dist.png"
    _, doc = bench(smol_server, tmp_path, "--dataset", "random", "--input-len", "12", "--output-len", "3",
                   "--num-prompts", "2", "--concurrency", "2", "--plot", str(png))
    assert doc["successful_requests"] == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_bench_serve_jsonl_file(smol_server, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "Hi"}], "output_len": 2}) + "\n")
    _, doc = bench(smol_server, tmp_path, "--dataset", str(data), "--num-prompts", "2", "--concurrency", "2",
                   "--output-len", "3")
    assert doc["successful_requests"] == 2 and doc["total_output_tokens"] == 5


def test_find_mt_bench():
    p = find_mt_bench()
    assert p.name == "mt_bench_questions.jsonl" and p.is_file()
    assert find_mt_bench(str(p)) == p
    with pytest.raises(ValueError):
        find_mt_bench(str(Path("/nonexistent/q.jsonl")))


def test_bench_serve_unreachable_is_a_user_error(tmp_path):
    p = subprocess.run([sys.executable, "-m", "blitzllm.cli", "bench", "serve", "--base-url", "http://127.0.0.1:9",
                        "--num-prompts", "1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "cannot reach" in p.stderr and "Traceback" not in p.stderr


def test_find_mt_bench_falls_back_to_the_packaged_copy(tmp_path, monkeypatch):
    """Without a shared/ above the working directory or the package, the copy shipped with the
    package is used, and it holds the same 80 questions as the project's shared file."""
    import blitzllm.bench.serve as serve
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(serve, "__file__", str(tmp_path / "pkg" / "serve.py"))
    p = serve.find_mt_bench()
    assert p == serve.MT_BENCH_BUNDLED
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    assert [r["question_id"] for r in rows] == list(range(81, 161))
    assert all(r["turns"] and isinstance(r["turns"][0], str) for r in rows)
    shared = [d / serve.MT_BENCH_REL for d in Path(__file__).resolve().parents]
    shared = [s for s in shared if s.is_file()]
    if shared:  # in a checkout beside the project's shared/: the copy is that file
        assert p.read_bytes() == shared[0].read_bytes()
