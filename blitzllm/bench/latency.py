"""Decode latency at a fixed batch, beside the memory-bandwidth roofline.

`blitz bench latency --model M --batch-size B --input-len I --output-len O [--compare hf,llamacpp]`
prints (and with --json writes) tokens_per_s, ms_per_token, ttft_s, bytes_per_step,
copy_bandwidth_Bps, roofline_fraction, startup_s, kernels_per_step / kernels_per_layer (CUDA),
cpu_decode / cpu_compile_s (CPU), and with llamacpp a long prompt's TTFT for both (docs/cpu.md).
"""
from __future__ import annotations

import json
import sys
import time

import torch

from ..cli_args import check_output_file, engine_kwargs
from ..sampling_params import SamplingParams
from .roofline import (copy_bandwidth, count_kernels, kv_bytes_per_step, state_bytes_per_step, sync,
                       weight_bytes_per_step)

CPU_REPEATS = 3  # CPU rounds of ours and each peer back to back (paired_rounds): medians of 3
HF_COMPILED_REPEATS = 3  # --compare hf: the compiled peer's decode time is the median of 3 estimates


def add_args(p, add_engine_args) -> None:
    add_engine_args(p)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--compare", default=None,
                   help="comma list of peers timed in the same run: hf (transformers on the same weights), "
                        "llamacpp (llama-cpp-python on the same .gguf, CPU), vllm (vLLM on the same HF folder, "
                        "weights in the dtype ours are stored in; optional), nospec (this engine with "
                        "--speculative-config switched off)")
    p.add_argument("--long-prompt-len", type=int, default=1000,
                   help="with --compare llamacpp: TTFT of one prompt this long, both engines")
    p.add_argument("--llamacpp-no-extra-bufts", action="store_true",
                   help="llama.cpp without its extra buffer types (weight repacking, AMX): for a CPU that "
                        "reports AMX but does not enable it, where a native build dies of SIGILL")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="every request under a random LoRA adapter of this rank (enable_lora; "
                        "--enforce-eager for the eager path's figure)")
    p.add_argument("--json", default=None, help="write the results to this file")


def _prompts(B, I, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (B, I), generator=g)


def _timed_run(eng, prompts, output_len, tag, lora=None):
    """Runs B requests to completion (under ``lora``, a LoRARequest); returns (ttft_s,
    per-decode-step seconds)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    dev = eng.device
    sync(dev)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts.tolist()):
        eng.add_request(f"{tag}-{i}", p, params, lora_request=lora)
    steps, ttft = [], None
    last = t0
    while eng.has_unfinished():
        eng.step()  # returns after the sampled tokens reached the host
        now = time.perf_counter()
        if ttft is None:
            ttft = now - t0
        else:
            steps.append(now - last)
        last = now
    return ttft, steps


def run(a) -> int:
    from ..llm import LLM
    B, I, O = a.batch_size, a.input_len, a.output_len
    if B < 1 or I < 1 or O < 2:
        raise ValueError("--batch-size and --input-len must be >= 1 and --output-len >= 2")
    check_output_file(a.json, "--json")
    kw = engine_kwargs(a)
    if kw["max_num_batched_tokens"] is None:
        kw["max_num_batched_tokens"] = max(B * I, 2048)
    if kw["max_num_seqs"] >= 1:  # (a value below 1 reaches the engine's argument check)
        kw["max_num_seqs"] = max(kw["max_num_seqs"], B)
    kw["enable_prefix_caching"] = False  # every run must compute its prompt
    peers = [x.strip() for x in (a.compare or "").split(",") if x.strip()]
    bad = [x for x in peers if x not in ("hf", "llamacpp", "vllm", "nospec")]
    if bad:
        raise ValueError(f"--compare takes hf, llamacpp, vllm and/or nospec, got {', '.join(bad)}")
    if "nospec" in peers and not getattr(a, "speculative_config", None):
        raise ValueError("--compare nospec needs --speculative-config")
    tp = kw["tensor_parallel_size"]
    if tp > 1 and any(p != "nospec" for p in peers):
        raise ValueError("--compare hf/llamacpp runs the peers on one device: use it with --tensor-parallel-size 1")
    if "vllm" in peers:
        from .vllm_peer import require_vllm
        require_vllm(a.model)
    if a.lora_rank is not None:
        if peers:
            raise ValueError("--lora-rank times this engine alone: leave out --compare")
        kw.update(enable_lora=True, max_lora_rank=a.lora_rank)
    long_len = a.long_prompt_len if "llamacpp" in peers else 0
    if kw["max_model_len"] is None:
        kw["max_model_len"] = max(I + max(O, 8), long_len + 8)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    startup_s = time.perf_counter() - t0
    eng = llm.engine
    cfg, dev = eng.model_config, eng.device
    lora = _random_lora(eng, a.lora_rank) if a.lora_rank is not None else None
    _timed_run(eng, _prompts(B, I, cfg.vocab_size, 1), min(O, 8), "warm", lora)
    if eng.spec is not None:
        eng.spec.reset_counters()
    peer_timers, llama = _peer_timers(a, eng, cfg, peers, B, I, O, dev)

    rounds = iter(range(CPU_REPEATS))

    def ours():  # seconds per generated token after the first (a speculative step may emit several)
        ttft, steps = _timed_run(eng, _prompts(B, I, cfg.vocab_size, 2), O, f"run{next(rounds)}", lora)
        return sum(steps) / (O - 1), ttft

    if dev.type != "cpu":
        # ours, then everything that steps our engine (TTFT, kernel counts, no-speculation), then each
        # peer once: our engine's CUDA graphs failed to launch in a step after transformers' compiled
        # peer had run (its own CUDA graphs over the weights it shares with ours)
        runs, peer_runs = [ours()], None
    else:
        runs, peer_runs = paired_rounds(ours, peer_timers, CPU_REPEATS)
    step_s, ttft = _median(runs)
    dtype_bytes = torch.finfo(eng.dtype).bits // 8
    w_bytes = weight_bytes_per_step(eng.runner.model, B)
    cache_bytes = eng.runner.kv_caches[cfg.kv_layers[0]][0].element_size() if cfg.kv_layers else dtype_bytes
    kv_bytes = kv_bytes_per_step(cfg, [I + O // 2] * B, dtype_bytes, tp, cache_bytes)  # per rank, like the weights
    st_bytes = state_bytes_per_step(cfg, B, dtype_bytes, tp)  # hybrid models' GDN states, read and written
    bw = copy_bandwidth(dev)
    res = {
        "model": a.model, "device": str(dev), "dtype": str(eng.dtype).replace("torch.", ""),
        "weight_dtype": _weight_format(eng),
        "num_layers": cfg.num_layers, "tensor_parallel_size": tp, "batch_size": B, "input_len": I, "output_len": O,
        "tokens_per_s": B / step_s, "tokens_per_s_per_user": 1.0 / step_s, "ms_per_token": step_s * 1e3,
        "ttft_s": ttft, "bytes_per_step": w_bytes + kv_bytes + st_bytes, "weight_bytes_per_step": w_bytes,
        "kv_bytes_per_step": kv_bytes, "state_bytes_per_step": st_bytes, "copy_bandwidth_Bps": bw,
        "roofline_fraction": (w_bytes + kv_bytes + st_bytes) / bw / step_s,
        "startup_s": startup_s,
    }
    if lora is not None:
        res["lora_rank"] = a.lora_rank
        res["cuda_graphs"] = eng.runner.graphs is not None
    cpu_decode = getattr(eng.runner, "cpu_decode", None)
    if cpu_decode is not None:
        res["cpu_decode"] = "compiled" if cpu_decode.compiled else "eager"
        res["cpu_compile_s"] = cpu_decode.compile_s
    if long_len:
        res["ttft_long_prompt_len"] = long_len
        res["ttft_long_s"] = _long_ttft(eng, long_len, cfg)
    if eng.spec is not None:
        res.update(_spec_stats(eng))
    if dev.type == "cuda":
        res.update(_kernel_counts(eng, cfg, B, I, lora))
    if "nospec" in peers:
        res.update(_compare_nospec(eng, B, I, O, cfg, res["tokens_per_s"]))
    if peer_runs is None:
        peer_runs = {name: [timer()] for name, timer in peer_timers.items()}
    for name, times in peer_runs.items():
        res[f"{name}_tokens_per_s"] = B / _median(times)
        res[f"speedup_vs_{name}"] = _median([t / o for t, (o, _) in zip(times, runs)])
    if long_len:
        res["llamacpp_ttft_long_s"] = llama.long_ttft(long_len, cfg.vocab_size)
        res["ttft_long_vs_llamacpp"] = res["ttft_long_s"] / res["llamacpp_ttft_long_s"]
    llm.close()
    _print(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def _random_lora(eng, rank: int):
    """A LoRARequest of a random rank-``rank`` adapter on every projection the engine wraps."""
    import tempfile
    from ..lora import LoRARequest
    from ..lora.adapter import write_random_adapter
    folder = tempfile.mkdtemp(prefix="blitz-bench-lora-")
    write_random_adapter(eng.lora.modules, folder, rank)
    return LoRARequest("bench", 1, folder)


def _spec_stats(eng) -> dict:
    """Speculation counters of the timed run; synthetic acceptance is labelled as such."""
    s = eng.stats()
    out = {k: s[k] for k in ("spec_method", "spec_num_speculative_tokens", "spec_synthetic")}
    if s["spec_synthetic"]:
        out["spec_synthetic_acceptance_rate"] = s["spec_synthetic_acceptance_rate"]
    out.update({k: s[k] for k in ("spec_draft_tokens", "spec_accepted_tokens", "spec_mean_acceptance_length")})
    out["spec_acceptance_per_position"] = " ".join(f"{a:.3f}" for a in s["spec_acceptance_per_position"])
    return out


def _compare_nospec(eng, B, I, O, cfg, ours_tps) -> dict:
    """The same engine, prompts and lengths with speculation switched off."""
    spec, eng.spec = eng.spec, None
    try:
        _, steps = _timed_run(eng, _prompts(B, I, cfg.vocab_size, 2), O, "nospec")
    finally:
        eng.spec = spec
    tps = B * (O - 1) / sum(steps)
    return {"nospec_tokens_per_s": tps, "speedup_vs_nospec": ours_tps / tps}


def _kernel_counts(eng, cfg, B, I, lora=None) -> dict:
    # long enough that the profiled step still decodes when speculation emits several
    # tokens per step; under the timed run's adapter, if any
    params = SamplingParams(temperature=0.0, max_tokens=max(2, min(64, eng.max_model_len - I)), ignore_eos=True)
    for i, p in enumerate(_prompts(B, I, cfg.vocab_size, 3).tolist()):
        eng.add_request(f"prof-{i}", p, params, lora_request=lora)
    eng.step()  # prefill
    eng.step()
    # several pipelined steps: the timeline then shows whether the GPU waits for the host
    steps = max(1, min(8, params.max_tokens - 4))
    n, names, micros, timeline = count_kernels(eng.step, eng.device, steps=steps)
    for i in range(B):
        eng.abort_request(f"prof-{i}")
    return {"kernels_per_step": n, "kernels_per_layer": n / cfg.num_layers, "kernel_names": names,
            "kernel_time_us": {k: round(v, 1) for k, v in micros.items()},
            "kernel_busy_us": round(sum(micros.values()), 1),
            "gpu_span_us_per_step": round(timeline["span_us"], 1),
            "gpu_idle_us_per_step": round(timeline["idle_us"], 1),
            "kernel_overlap_us_per_step": round(timeline["overlap_us"], 1),
            "gpu_copy_us_per_step": round(timeline["copy_us"], 1),
            "kernel_exposed_us": {k: round(v, 1) for k, v in timeline["exposed_us"].items()},
            "kernel_sequence": [[k, round(s, 2), round(e, 2)] for k, s, e in timeline["sequence"]]}


def _median(xs):
    return sorted(xs)[len(xs) // 2]


def paired_rounds(ours, peers: dict, rounds: int):
    """``rounds`` rounds, each calling ``ours`` (-> (seconds per token, ttft)) and every peer's
    timer (-> seconds per token) back to back, the order reversed every other round. On a CPU
    whose bandwidth wanders over minutes (a shared VM) the speedups are then taken within a round
    (the median of the rounds' ratios), not as a ratio of medians timed minutes apart. Returns
    (ours' results, {peer: its times})."""
    runs, peer_runs = [], {name: [] for name in peers}
    for r in range(rounds):
        order = [lambda: runs.append(ours())] + [lambda n=n: peer_runs[n].append(peers[n]()) for n in peers]
        for f in (order if r % 2 == 0 else order[::-1]):
            f()
    return runs, peer_runs


def _peer_timers(a, eng, cfg, peers, B, I, O, dev):
    """({peer name: a function that times one decode estimate, seconds per generated token}, the
    llama.cpp peer or None), the peers built and warmed: hf_eager (and on CUDA hf_compiled), vllm,
    llamacpp."""
    timers, llama = {}, None
    if "hf" in peers:
        from .hf_peer import build_hf_peer, hf_decode_seconds_per_token
        model = eng.runner.model
        if eng.weight_dtype != eng.dtype:
            # our weights are stored in another dtype: the peer runs the model in its plain dtype
            from ..loader.source import resolve_model
            from ..runner.build import build_model
            model = build_model(resolve_model(a.model, a.load_format, a.hf_overrides), cfg, dev, eng.dtype, a.seed)
        hf = build_hf_peer(model, cfg)
        prompts = _prompts(B, I, cfg.vocab_size, 4).to(dev)
        timers["hf_eager"] = lambda: hf_decode_seconds_per_token(hf, prompts, O, compiled=False)
        if dev.type == "cuda":
            timers["hf_compiled"] = lambda: hf_decode_seconds_per_token(hf, prompts, O, compiled=True,
                                                                        repeats=HF_COMPILED_REPEATS)
    if "vllm" in peers:
        from .vllm_peer import VllmPeer
        wd = eng.weight_dtype if isinstance(eng.weight_dtype, torch.dtype) else eng.dtype
        timers["vllm"] = VllmPeer(a.model, str(wd).replace("torch.", ""), _prompts(B, I, cfg.vocab_size, 6).tolist(),
                                  O, I + O + 8).decode_seconds_per_token
    if "llamacpp" in peers:
        llama = _LlamaPeer(a.model, B, I, O, max(I + O, a.long_prompt_len) + 8, cfg.vocab_size,
                           a.llamacpp_no_extra_bufts)
        timers["llamacpp"] = llama.decode_seconds_per_token
    return timers, llama


def _weight_format(eng) -> str:
    """The linears' storage: a dtype, int4 / fp8, or 'gguf-grid' (a GGUF's codes kept, CPU)."""
    if eng.weight_dtype == "auto":
        kept = any(getattr(m, "quant", None) is not None for m in eng.runner.model.modules())
        return "gguf-grid" if kept else str(eng.dtype).replace("torch.", "")
    return str(eng.weight_dtype).replace("torch.", "")


def _long_ttft(eng, n, cfg) -> float:
    """Seconds from adding one uncached n-token prompt to its first token (the median of 3)."""
    runs = [_timed_run(eng, _prompts(1, n, cfg.vocab_size, 10 + r), 2, f"long{r}") for r in range(3)]
    return _median([ttft for ttft, _ in runs])


def _llama(path, n_ctx, no_extra_bufts: bool):
    """llama_cpp.Llama on ``path`` with this machine's threads (``no_extra_bufts``: model
    parameters with use_extra_bufts off, which the Llama class does not expose)."""
    import os

    import llama_cpp.llama as ll
    from llama_cpp import Llama
    low = ll.llama_cpp
    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    if no_extra_bufts:
        low.llama_model_default_params = params
    try:
        return Llama(model_path=str(path), n_ctx=n_ctx, n_threads=os.cpu_count(), verbose=False)
    finally:
        low.llama_model_default_params = default


class _LlamaPeer:
    """llama.cpp through llama-cpp-python on the same GGUF file (its own quantized kernels)."""

    def __init__(self, model, B, I, O, n_ctx, vocab, no_extra_bufts: bool):
        from pathlib import Path
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise ValueError("--compare llamacpp needs llama-cpp-python: pip install llama-cpp-python") from None
        from ..loader.source import smollm2_path
        path = smollm2_path() if model == "smollm2" else Path(model)
        if path.suffix != ".gguf" or B != 1:
            raise ValueError("--compare llamacpp needs a .gguf model (or smollm2) and --batch-size 1")
        self.lm, self.O = _llama(path, n_ctx, no_extra_bufts), O
        self.prompt = _prompts(1, I, vocab, 5)[0].tolist()
        self._decode_time(8)

    def _decode_time(self, n) -> float:
        self.lm.reset()
        first = None
        for i, _ in enumerate(self.lm.generate(self.prompt, temp=0.0, reset=True)):
            if i == 0:
                first = time.perf_counter()
            if i + 1 >= n:
                break
        return time.perf_counter() - first

    def decode_seconds_per_token(self) -> float:
        return self._decode_time(self.O) / (self.O - 1)

    def long_ttft(self, n, vocab) -> float:
        """Seconds to the first token of an n-token prompt (the median of 3, as ours)."""
        times = []
        for r in range(3):
            long_prompt = _prompts(1, n, vocab, 10 + r)[0].tolist()
            self.lm.reset()
            t = time.perf_counter()
            next(iter(self.lm.generate(long_prompt, temp=0.0, reset=True)))
            times.append(time.perf_counter() - t)
        return _median(times)


def _print(res: dict) -> None:
    w = max(len(k) for k in res)
    for k, v in res.items():
        if isinstance(v, (dict, list)):
            continue  # detail for the JSON file
        if isinstance(v, float):
            v = f"{v:.4g}" if abs(v) < 1e5 else f"{v:.4e}"
        print(f"{k:<{w}}  {v}")
    sys.stdout.flush()
