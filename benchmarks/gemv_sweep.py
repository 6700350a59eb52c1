#!/usr/bin/env python3
"""Decode GEMV benchmark: blitzllm's Triton gemv (heuristic + a config sweep) vs cuBLAS.

    python3 benchmarks/gemv_sweep.py [--quick] [--ms 1,4,16] [--budget-s 210]
    python3 benchmarks/gemv_sweep.py --smoke      # CPU: one tiny shape under TRITON_INTERPRET=1

For every (N, K) layer shape of llama-3.1-8b and qwen3-0.6b and every M: checks each gemv
variant against torch.nn.functional.linear (bf16; max abs error / max |ref|), then times it
and cuBLAS two ways: CUDA events around >= 50 back-to-back eager calls (host launch
overhead included when the kernel is shorter than it), and replays of a CUDA graph of
>= 20 captured calls (how decode runs). Every timed loop cycles through enough copies of W
(>= 200 MB in all) that each call reads W from HBM, not from the 50 MB L2. GB/s counts
W + x + out bytes per call; "frac" is that over 4.28e12 B/s. The "down+silu" rows fuse
silu(gate) * up into the gemv; their cuBLAS baseline is silu_and_mul + F.linear.
Prints one line per variant as it goes, a summary table last, and writes every result
to $OUT/gemv_bench.json when OUT is set. Once --budget-s has passed, the remaining cases
time only cuBLAS and the heuristic config.
"""
import argparse
import importlib.util
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PEAK = 4.28e12  # B/s
MIN_BYTES = 200e6  # per timed loop: 4x the H200's L2


def layers(model, hidden, inter, q_width, kv_width, vocab):
    """(model, layer, N, K, silu_mul_input) of one decoder layer and the lm_head."""
    return [(model, "qkv", q_width + 2 * kv_width, hidden, False), (model, "o_proj", hidden, q_width, False),
            (model, "gate_up", 2 * inter, hidden, False), (model, "down", hidden, inter, False),
            (model, "down+silu", hidden, inter, True), (model, "lm_head", vocab, hidden, False)]


SHAPES = (layers("llama-3.1-8b", 4096, 14336, 4096, 1024, 128256)
          + layers("qwen3-0.6b", 1024, 3072, 2048, 1024, 151936)
          # qwen3-30b-a3b's attention projections and lm_head (its MLPs are experts: bench_moe.py)
          + [s for s in layers("qwen3-30b-a3b", 2048, 768, 4096, 512, 151936)
             if s[1] in ("qkv", "o_proj", "lm_head")])


def sweep(m):
    """Tiles to try at m rows (SPLIT_K left to the heuristic for the tile), besides the
    heuristic itself and its SPLIT_K=1 / SPLIT_K=4 variants (strategy a vs b)."""
    if m <= 2:  # fp32 FMA path (num_stages has no effect there), and two tensor-core ones
        cfgs = [dict(DOT=False, BLOCK_N=bn, BLOCK_K=bk, num_warps=w) for bn, bk, w in
                [(2, 1024, 4), (4, 512, 4), (4, 1024, 4), (8, 256, 2), (8, 512, 4),
                 (16, 512, 8), (16, 256, 4)]]
        return cfgs + [dict(DOT=True, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=3),
                       dict(DOT=True, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4)]
    cfgs = [dict(DOT=True, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s) for bn, bk, w, s in
            [(16, 256, 4, 3), (16, 512, 4, 3), (32, 256, 4, 3), (32, 128, 4, 4), (32, 256, 8, 4),
             (64, 128, 4, 3), (64, 128, 2, 3), (128, 128, 4, 3), (16, 256, 2, 2)]]
    if m <= 8:  # the FMA path with more rows (its accumulator [BN, M, BK] caps BN)
        cfgs += [dict(DOT=False, BLOCK_N=bn, BLOCK_K=bk, num_warps=w) for bn, bk, w in
                 [(4, 512, 4), (2, 1024, 4), (4, 1024, 8), (8, 256, 4), (2, 512, 2)]]
    return cfgs


def cfg_str(c):
    return (f"{'dot' if c['DOT'] else 'fma'} n{c['BLOCK_N']} k{c['BLOCK_K']} s{c['SPLIT_K']} "
            f"w{c['num_warps']} st{c['num_stages']}")


def time_events(fn, ws, torch):
    """us per call over >= 50 back-to-back calls (each on the next copy of W)."""
    iters = max(50, 2 * len(ws))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fn(ws[i % len(ws)])
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def time_graph(fn, ws, torch):
    """us per call: one graph of max(20, copies) calls (every copy once), replayed."""
    calls = max(20, len(ws))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (allocations, cuBLAS workspace)
        fn(ws[0])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(ws[i % len(ws)])
    graph.replay()
    reps = max(3, math.ceil(100 / calls))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (reps * calls)


def run(args):
    import torch
    import torch.nn.functional as F

    from blitzllm.kernels._common import device_sms
    from blitzllm.kernels.activation import silu_and_mul
    from blitzllm.kernels.gemv.gemv import gemv_config, gemv_triton

    dev = "cpu" if args.smoke else "cuda"
    dt = torch.bfloat16
    shapes = [("tiny", "mlp", 40, 1000, False), ("tiny", "down+silu", 40, 1000, True)] if args.smoke else SHAPES
    if args.quick:
        shapes = [s for s in shapes if s[1] in ("qkv", "down", "down+silu", "lm_head")]
    if args.models:
        shapes = [s for s in shapes if s[0] in args.models.split(",")]
    if args.layers:
        shapes = [s for s in shapes if s[1] in args.layers.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    t0 = time.time()
    results, summary = [], []
    torch.manual_seed(0)
    for model, layer, n, k, silu in shapes:
        w_bytes = n * k * dt.itemsize
        copies = 1 if args.smoke else max(2, math.ceil(MIN_BYTES / w_bytes))
        ws = [torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5 for _ in range(copies)]
        for m in ms:
            x = torch.randn(m, 2 * k if silu else k, device=dev, dtype=dt)
            nbytes = w_bytes + x.numel() * dt.itemsize + m * n * dt.itemsize
            sms = device_sms(x)
            heur = gemv_config(m, n, k, dt, sms, silu_mul_input=silu)
            variants = [("cublas", None), ("heuristic", heur),
                        ("heur-split1", dict(heur, SPLIT_K=1)), ("heur-split4", dict(heur, SPLIT_K=4))]
            over = time.time() - t0 > args.budget_s
            if not over:
                variants += [(f"sweep{i}", c) for i, c in enumerate(sweep(m))]
            seen, ref = set(), None
            for name, cfg in variants:
                if cfg is None:  # the baseline (unfused with silu)
                    def fn(w, x=x):
                        return F.linear(silu_and_mul(x) if silu else x, w)
                    label = "cuBLAS" + (" + silu_and_mul" if silu else "")
                else:
                    cfg = gemv_config(m, n, k, dt, sms, cfg, silu)
                    key = tuple(sorted(cfg.items()))
                    if key in seen:
                        continue
                    seen.add(key)

                    def fn(w, x=x, cfg=cfg):
                        return gemv_triton(x, w, silu_mul_input=silu, config=cfg)
                    label = cfg_str(cfg)
                rec = dict(model=model, layer=layer, N=n, K=k, M=m, silu=silu, variant=name,
                           config=cfg, label=label)
                try:
                    ref = fn(ws[0]).float() if ref is None else ref
                    rel_err = lambda: (fn(ws[0]).float() - ref).abs().max().item() / ref.abs().max().item()  # noqa: E731
                    rec["rel_err"] = max(rel_err(), rel_err())  # twice: the split-K buffers reset
                    if not args.smoke:
                        rec["us_event"] = time_events(fn, ws, torch)
                        rec["us_graph"] = time_graph(fn, ws, torch)
                        for mode in ("event", "graph"):
                            rec[f"gbps_{mode}"] = nbytes / rec[f"us_{mode}"] / 1e3
                        rec["frac_graph"] = nbytes / (rec["us_graph"] * 1e-6) / PEAK
                        rec["rel_err"] = max(rec["rel_err"], rel_err())  # still right after ~200 calls
                except Exception as e:  # a config that does not compile / fit: report, go on
                    rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                results.append(rec)
                print(f"{model:13s}{layer:10s}M={m:<3d}{label:34s}" + (
                    f"ERROR {rec['error']}" if "error" in rec else
                    f"err {rec['rel_err']:.1e}{'  BAD' if rec['rel_err'] > 2e-2 else ''}" + (
                        f"  ev {rec['us_event']:8.1f} us  graph {rec['us_graph']:8.1f} us "
                        f"{rec['gbps_graph']:6.0f} GB/s  {rec['frac_graph']:.2f}" if "us_graph" in rec else "")),
                    flush=True)
            summary.append(summarize([r for r in results if (r["model"], r["layer"], r["M"]) == (model, layer, m)],
                                     over))
            write_json(results, summary)
        ws.clear()  # free the copies before the next shape
        if not args.smoke:
            torch.cuda.empty_cache()
    print(f"\n== summary (graph-replay timings; bf16; {time.time() - t0:.0f} s)")
    print(f"{'model':13s}{'layer':10s}{'M':>3s} {'cuBLAS us':>9s} {'heur us':>8s} {'best us':>8s} "
          f"{'frac':>5s} {'speedup':>7s} {'max err':>8s}  best config")
    for s in summary:
        f = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
        print(f"{s['model']:13s}{s['layer']:10s}{s['M']:3d} {f(s['cublas_us']):>9s} {f(s['heur_us']):>8s} "
              f"{f(s['best_us']):>8s} {f(s['best_frac'], 2):>5s} {f(s['speedup'], 2):>7s} "
              f"{s['max_err']:8.1e}  {s['best']}{' (budget: sweep skipped)' if s['skipped'] else ''}")
    bad = [r for r in results if "error" in r or r.get("rel_err", 0) > 2e-2]
    print(f"{len(bad)} variant(s) failed or exceeded 2e-2 relative error")
    return 1 if args.smoke and bad else 0


def summarize(rows, skipped):
    gem = [r for r in rows if r["variant"] != "cublas" and "us_graph" in r and r["rel_err"] <= 2e-2]
    cub = next((r for r in rows if r["variant"] == "cublas"), {})
    heur = next((r for r in rows if r["variant"] == "heuristic"), {})
    best = min(gem, key=lambda r: r["us_graph"]) if gem else {}
    ok = [r["rel_err"] for r in rows if "rel_err" in r]
    return dict(model=rows[0]["model"], layer=rows[0]["layer"], M=rows[0]["M"], skipped=skipped,
                cublas_us=cub.get("us_graph"), heur_us=heur.get("us_graph"), best_us=best.get("us_graph"),
                best_frac=best.get("frac_graph"), best=best.get("label", "-"), best_config=best.get("config"),
                speedup=cub["us_graph"] / best["us_graph"] if best and cub.get("us_graph") else None,
                cublas_frac=cub.get("frac_graph"), max_err=max(ok) if ok else float("nan"))


def write_json(results, summary):
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gemv_bench.json"), "w") as f:
            json.dump({"peak_Bps": PEAK, "results": results, "summary": summary}, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU check under the Triton interpreter, no timing")
    ap.add_argument("--quick", action="store_true", help="qkv, down, down+silu and lm_head only")
    ap.add_argument("--ms", default="1,4,16", help="rows of x (comma separated, <= 16)")
    ap.add_argument("--models", default="", help="only these models (comma separated)")
    ap.add_argument("--layers", default="", help="only these layers, e.g. qkv,o_proj,down")
    ap.add_argument("--budget-s", type=float, default=210.0,
                    help="after this many seconds only cuBLAS and the heuristic are timed")
    args = ap.parse_args()
    if args.smoke:
        args.ms = "1,3" if args.ms == "1,4,16" else args.ms
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        # the interpreter fixes the kernel tests use (runtime loop bounds, bf16 tl.dot)
        spec = importlib.util.spec_from_file_location(
            "_kernel_conftest", os.path.join(ROOT, "tests", "kernels", "conftest.py"))
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    sys.exit(run(args))


if __name__ == "__main__":
    main()
