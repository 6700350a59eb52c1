"""Serving benchmark: an async streaming client that load-tests an OpenAI-compatible server.

Owns the request generator (random, mt-bench or a JSONL file), the client and its report
(throughput, TTFT / TPOT / ITL / E2EL mean, median, p99). Talks HTTP only, so it measures any
server that speaks the API (blitz, vLLM, SGLang...).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .. import envs
from ..cli_args import check_output_file

MT_BENCH_REL = Path("shared") / "data" / "mt_bench_questions.jsonl"
# a copy shipped with the package (MT-bench is Apache-2.0), used when no shared/ is found
MT_BENCH_BUNDLED = Path(__file__).resolve().parent / "data" / "mt_bench_questions.jsonl"


@dataclass
class BenchRequest:
    prompt: object               # str or list of token ids (completions) or a messages list (chat)
    chat: bool
    output_len: int
    input_len: Optional[int] = None   # known up front for token-id prompts


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list = field(default_factory=list)


# ---- datasets -----------------------------------------------------------------------
def find_mt_bench(path: Optional[str] = None) -> Path:
    """The MT-bench question file: ``path`` if given, else ``shared/data/...`` found walking up
    from the working directory and from this package (also as a sibling ``../shared``), else
    the copy shipped with the package."""
    if path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ValueError(f"--dataset-path {path} does not exist")
        return p
    for start in (Path.cwd().resolve(), Path(__file__).resolve().parent):
        for d in [start, *start.parents]:
            for cand in (d / MT_BENCH_REL, d.parent / MT_BENCH_REL):
                if cand.is_file():
                    return cand
    if MT_BENCH_BUNDLED.is_file():
        return MT_BENCH_BUNDLED
    raise ValueError(f"cannot find {MT_BENCH_REL} above {Path.cwd()}; pass --dataset-path FILE")


def _read_jsonl(path: Path) -> list:
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    return rows


def _row_to_request(row, output_len: int, where: str) -> BenchRequest:
    row = row if isinstance(row, dict) else {}
    out = int(row.get("output_len") or row.get("max_tokens") or output_len)
    if isinstance(row.get("messages"), list):
        return BenchRequest(row["messages"], True, out)
    if isinstance(row.get("turns"), list) and row["turns"]:
        return BenchRequest([{"role": "user", "content": str(row["turns"][0])}], True, out)
    if isinstance(row.get("prompt"), (str, list)):
        p = row["prompt"]
        return BenchRequest(p, False, out, len(p) if isinstance(p, list) else None)
    raise ValueError(f"{where}: each line needs 'messages', 'turns' or 'prompt'")


def build_requests(args, vocab_size: Optional[int]) -> list:
    rng = random.Random(args.seed)
    n = args.num_prompts
    if args.dataset == "random":
        hi = max(2, min(vocab_size or 32000, 32000))
        lo = min(100, hi - 1)
        return [BenchRequest([rng.randrange(lo, hi) for _ in range(args.input_len)], False, args.output_len,
                             args.input_len) for _ in range(n)]
    if args.dataset == "mt-bench":
        rows = _read_jsonl(find_mt_bench(args.dataset_path))
    else:
        p = Path(args.dataset).expanduser()
        if not p.is_file():
            raise ValueError(f"--dataset must be random, mt-bench or an existing .jsonl file, got {args.dataset!r}")
        rows = _read_jsonl(p)
    base = [_row_to_request(r, args.output_len, f"{args.dataset} line {i + 1}") for i, r in enumerate(rows)]
    return [base[i % len(base)] for i in range(n)]


# ---- the client ---------------------------------------------------------------------
def _payload(req: BenchRequest, model: str, args) -> dict:
    body = {"model": model, "max_tokens": req.output_len, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": not args.no_ignore_eos}
    if req.chat:
        body["messages"] = req.prompt
    else:
        body["prompt"] = req.prompt
    return body


async def send_one(client, base_url: str, req: BenchRequest, model: str, args) -> RequestResult:
    res = RequestResult(prompt_tokens=req.input_len or 0)
    url = base_url + ("/v1/chat/completions" if req.chat else "/v1/completions")
    t0 = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=_payload(req, model, args)) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                try:
                    body = json.loads(body)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                res.error = f"HTTP {r.status_code}: {str(body)[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = f"stream error: {obj['error'].get('message', obj['error'])}"
                    return res
                if obj.get("usage"):
                    res.prompt_tokens = obj["usage"].get("prompt_tokens", res.prompt_tokens)
                    res.output_tokens = obj["usage"].get("completion_tokens", 0)
                for ch in obj.get("choices") or []:
                    if req.chat:
                        delta = ch.get("delta") or {}
                        text, is_role = delta.get("content"), "role" in delta
                    else:
                        text, is_role = ch.get("text"), False
                    # a token arrived: new text, or an empty non-final delta (a model with no tokenizer)
                    if text or (text == "" and not is_role and ch.get("finish_reason") is None):
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
        res.e2el = time.perf_counter() - t0
        if not res.output_tokens:
            res.output_tokens = chunks
        res.ok = last is not None or res.output_tokens > 0
        if not res.ok:
            res.error = "the stream ended without any output"
    except Exception as e:  # noqa: BLE001 - every failure is counted, none stops the run
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _arrivals(n: int, rate: float, rng: random.Random):
    for i in range(n):
        yield i
        if rate != math.inf and i < n - 1:
            await asyncio.sleep(rng.expovariate(rate))


async def run_benchmark(args, requests: list, model: str) -> tuple:
    import httpx
    from tqdm import tqdm
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    sem = asyncio.Semaphore(args.concurrency)
    results: list = [None] * len(requests)
    bar = tqdm(total=len(requests), desc="requests", disable=args.no_progress, file=sys.stderr)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=30), limits=limits,
                                 headers=headers) as client:
        async def one(i):
            async with sem:
                results[i] = await send_one(client, base, requests[i], model, args)
            bar.update(1)

        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(one(i)) async for i in _arrivals(len(requests), args.request_rate,
                                                                        random.Random(args.seed + 1))]
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return results, duration


def _stats(xs: list, scale: float = 1000.0) -> dict:
    import numpy as np
    if not xs:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    a = np.asarray(xs, dtype=float) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def summarize(results: list, duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tok / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tok + out_tok) / duration if duration > 0 else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]), "e2el_ms": _stats([r.e2el for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }


def format_summary(s: dict) -> str:
    w = 50
    lines = [" Serving Benchmark Result ".center(w, "=")]

    def row(k, v):
        lines.append(f"{k:<40}{v:>10}")
    row("Successful requests:", s["successful_requests"])
    row("Failed requests:", s["failed_requests"])
    row("Benchmark duration (s):", f"{s['duration_s']:.2f}")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", f"{s['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")
    for key, title, short in (("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"), ("e2el_ms", "End-to-end Latency", "E2EL")):
        lines.append(f" {title} ".center(w, "-"))
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            row(f"{name} {short} (ms):", f"{s[key][stat]:.2f}")
    lines.append("=" * w)
    for e in s["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def plot(results: list, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, data, title in ((axes[0], [r.ttft * 1000 for r in ok], "Time to first token"),
                            (axes[1], [x * 1000 for r in ok for x in r.itl], "Inter-token latency")):
        ax.hist(data or [0.0], bins=min(50, max(5, len(data) // 4 or 5)), color="#3b6ea8")
        ax.set_title(f"{title} (n={len(data)})")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _server_model(args) -> tuple:
    """(model id, vocab size or None) from GET /v1/models; fails fast when unreachable."""
    import httpx
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {args.base_url}: {e}") from None
    if r.status_code != 200:
        raise ValueError(f"GET {args.base_url}/v1/models answered {r.status_code}: {r.text[:200]}")
    data = r.json().get("data") or []
    card = next((m for m in data if m.get("id") == args.model), data[0] if data else {})
    return args.model or card.get("id"), card.get("vocab_size")


def add_args(p: argparse.ArgumentParser, add_engine_args=None) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id to send (default: the server's first model)")
    p.add_argument("--api-key", default=envs.get("BLITZ_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="bearer key (default: $BLITZ_API_KEY, else $OPENAI_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at most")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (default: all at once)")
    p.add_argument("--dataset", default="random", help="random | mt-bench | FILE.jsonl")
    p.add_argument("--dataset-path", default=None,
                   help="the mt-bench questions file (default: found under shared/data)")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens (random dataset)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (ignore_eos)")
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--save-json", default=None)
    p.add_argument("--plot", default=None, help="PNG of the TTFT and ITL distributions (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true")


def run(args) -> int:
    for name, lo in (("num_prompts", 1), ("concurrency", 1), ("input_len", 1), ("output_len", 1)):
        if getattr(args, name) < lo:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {lo}, got {getattr(args, name)}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    for flag in ("save_json", "plot"):
        check_output_file(getattr(args, flag, None), "--" + flag.replace("_", "-"))
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # fail before the run, not after
        raise ValueError("--plot needs matplotlib: pip install matplotlib")
    model, vocab = _server_model(args)
    requests = build_requests(args, vocab)
    print(f"blitz bench serve: {len(requests)} requests to {args.base_url} (model {model}, dataset "
          f"{args.dataset}, concurrency {args.concurrency}, rate {args.request_rate}/s)", file=sys.stderr)
    results, duration = asyncio.run(run_benchmark(args, requests, model))
    s = summarize(results, duration)
    print(format_summary(s))
    if args.save_json:
        cfg = {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf") for k, v in vars(args).items()
               if isinstance(v, (str, int, float, bool, type(None))) and k != "api_key"}
        doc = {"config": {**cfg, "model": model}, **s,
               "ttfts_s": [r.ttft for r in results], "e2els_s": [r.e2el for r in results],
               "itls_s": [r.itl for r in results], "output_lens": [r.output_tokens for r in results],
               "input_lens": [r.prompt_tokens for r in results], "request_errors": [r.error for r in results]}
        Path(args.save_json).write_text(json.dumps(doc, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 0 if s["failed_requests"] == 0 else 1
