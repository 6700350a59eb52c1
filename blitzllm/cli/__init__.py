"""The ``blitz`` command: generate, chat, serve, run-batch, router, bench, train-draft.

User errors print one line on stderr and exit with status 2; no tracebacks.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from ..cli_args import add_engine_args, engine_kwargs


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        print(f"blitz: error: {message}", file=sys.stderr)
        sys.exit(2)


def _sampling(a, **extra):
    from ..sampling_params import SamplingParams
    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                          top_k=a.top_k, seed=a.seed_sample, **extra)


def _add_sampling_args(p):
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", dest="seed_sample", type=int, default=None,
                   help="per-request sampling seed (the engine --seed covers unseeded requests)")


def cmd_generate(a) -> int:
    from ..llm import LLM
    params = _sampling(a)
    llm = LLM(**engine_kwargs(a))
    if a.chat and llm.tokenizer is not None and getattr(llm.tokenizer, "chat_template", None):
        prompt = llm.apply_chat_template([{"role": "user", "content": a.prompt}])
    else:
        prompt = llm.tokenize(a.prompt)
    t0 = time.perf_counter()
    t_first = None
    for text in llm.stream(prompt, params):
        if t_first is None:
            t_first = time.perf_counter()
        sys.stdout.write(text)
        sys.stdout.flush()
    t1 = time.perf_counter()
    sys.stdout.write("\n")
    n = llm.stats()["generation_tokens"]
    prefill = (t_first or t1) - t0
    decode_tps = (n - 1) / (t1 - t_first) if n > 1 and t_first else 0.0
    print(f"[blitz] prompt {len(prompt)} tok in {prefill:.3f}s ({len(prompt) / max(prefill, 1e-9):.1f} tok/s), "
          f"decode {n} tok at {decode_tps:.1f} tok/s", file=sys.stderr)
    llm.close()
    return 0


def cmd_chat(a) -> int:
    from ..llm import LLM
    llm = LLM(**engine_kwargs(a))
    params = _sampling(a)
    history = []
    print("blitz chat: empty line or Ctrl-D to quit, /reset to clear the history", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            history = []
            continue
        history.append({"role": "user", "content": line})
        out = llm.chat(history, params, use_tqdm=False)[0]   # (no progress bar between the turns)
        print(out.text)
        history.append({"role": "assistant", "content": out.text})
    llm.close()
    return 0


def torchrun_worker(a) -> bool:
    """Under torchrun (or RANK / WORLD_SIZE set by hand), ranks > 0 of a tensor-parallel
    command serve rank 0's engine as workers instead of running the command."""
    if getattr(a, "tensor_parallel_size", 1) <= 1:
        return False
    from ..distributed.parallel_state import torchrun_env
    env = torchrun_env()
    if env is None or env.rank == 0:
        return False
    from ..engine.tp import run_worker
    from ..engine.engine import EngineArgs
    run_worker(EngineArgs(**engine_kwargs(a)), env)
    return True


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="blitz", description="blitzllm: LLM inference and serving")
    sub = p.add_subparsers(dest="cmd", parser_class=_Parser)
    g = sub.add_parser("generate", help="complete one prompt")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the model's chat template (default: on)")
    _add_sampling_args(g)
    add_engine_args(g)
    c = sub.add_parser("chat", help="interactive multi-turn chat")
    _add_sampling_args(c)
    add_engine_args(c)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    try:
        from ..server.app import add_serve_args
    except ImportError as e:  # the server stack is missing or broken: the rest of the CLI still works
        s.set_defaults(serve_import_error=f"blitz serve needs fastapi and uvicorn ({e}): pip install fastapi uvicorn")
    else:
        add_serve_args(s)
    add_engine_args(s)
    rb = sub.add_parser("run-batch", help="answer a file of OpenAI Batch API requests offline (vLLM's run-batch)")
    try:
        from ..server.batch import add_run_batch_args
    except ImportError as e:
        rb.set_defaults(serve_import_error=f"blitz run-batch needs fastapi ({e}): pip install fastapi uvicorn")
    else:
        add_run_batch_args(rb)
    add_engine_args(rb)
    from .router import add_router_args
    add_router_args(sub.add_parser("router", help="OpenAI-compatible router: prefill/decode disaggregation or replicas"))
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_cmd", parser_class=_Parser)
    from ..bench import register_bench_commands
    register_bench_commands(bsub, add_engine_args)
    from .train_draft import add_train_draft_args
    add_train_draft_args(sub.add_parser("train-draft", help="train an EAGLE-3 draft head from the engine's hidden states"))
    return p


def main(argv=None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    p = build_parser()
    a = p.parse_args(argv)
    if a.cmd is None:
        p.print_help()
        return 2
    try:
        if torchrun_worker(a):
            return 0
        if a.cmd == "generate":
            return cmd_generate(a)
        if a.cmd == "chat":
            return cmd_chat(a)
        if a.cmd == "serve":
            if getattr(a, "serve_import_error", None):
                raise ValueError(a.serve_import_error)
            from ..server.app import run_server
            return run_server(a)
        if a.cmd == "run-batch":
            if getattr(a, "serve_import_error", None):
                raise ValueError(a.serve_import_error)
            from ..server.batch import run_batch
            return run_batch(a)
        if a.cmd == "router":
            from .router import run_router
            return run_router(a)
        if a.cmd == "bench":
            if getattr(a, "bench_func", None) is None:
                p.error("bench needs a subcommand: latency, serve")
            return a.bench_func(a)
        if a.cmd == "train-draft":
            return a.func(a)
    except ValueError as e:
        print(f"blitz: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
