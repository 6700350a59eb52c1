#!/usr/bin/env python3
"""MoE kernel benchmark: router GEMM, expert selection and fused experts, Triton vs torch.

    python3 benchmarks/moe_kernels.py [--ts 1,4,16] [--moe-ts 1,16,256] [--budget-s 120]
    python3 benchmarks/moe_kernels.py --smoke     # CPU: tiny shapes under TRITON_INTERPRET=1, no timing

Models: Qwen3-30B-A3B (H 2048, E 128, softmax top-8 renormalised, I 768), DeepSeek-V3
(H 7168, E 256, sigmoid + bias, 8 groups / 4 kept, top-8, scaling 2.5), MiniMax-M2
(H 3072, E 256, sigmoid + bias, top-8 renormalised). bf16 activations and weights.

1. router GEMM: ``router_gemm_triton`` (heuristic + a few configs) vs ``(x @ w.t()).float()``.
2. routing: ``select_experts_triton`` vs ``reference_select_experts`` on the same logits,
   and the whole gate (router GEMM + routing) vs the torch sequence.
3. fused experts (Qwen3-30B-A3B sizes): ``fused_moe_triton`` (heuristic + configs at small T)
   vs ``reference_fused_moe``; GB/s counts the chosen experts' weights (+ x and out).

Timings are CUDA-graph replays of >= 20 captured calls cycling through copies of the weights
(>= 200 MB, so each call reads them from HBM, not L2) or through 8 different routings
(fused experts); the reference fused MoE syncs the host (torch.unique) and is timed eagerly
with CUDA events. Every variant is checked against its reference in the same run. Prints
one line per variant, a summary table last, and writes $OUT/moe_bench.json when OUT is set.
Once --budget-s has passed, only the baselines and the heuristic configs are timed.
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

PEAK = 4.8e12  # H200 HBM3e, B/s
MIN_BYTES = 200e6  # weight copies per timed router loop: 4x the H200's L2
ROUTINGS = 8  # different routings cycled through by the fused-experts timings
MODELS = {  # H, E, top_k, scoring, bias, n_group, topk_group, renormalize, scaling
    "qwen3-30b-a3b": (2048, 128, 8, "softmax", False, 1, 1, True, 1.0),
    "deepseek-v3": (7168, 256, 8, "sigmoid", True, 8, 4, True, 2.5),
    "minimax-m2": (3072, 256, 8, "sigmoid", True, 1, 1, True, 1.0),
}
QWEN_MOE = (128, 8, 2048, 768)  # E, K, H, I


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def router_sweep(t):
    if t <= 2:
        return [dict(DOT=False, BLOCK_E=2, BLOCK_H=512), dict(DOT=False, BLOCK_E=8, BLOCK_H=256),
                dict(DOT=True, BLOCK_E=16, BLOCK_H=128)]
    return [dict(DOT=True, BLOCK_E=be, BLOCK_H=bh) for be, bh in [(16, 128), (32, 128), (8, 256)]]


def moe_sweep():
    return [dict(BLOCK_N=bn, BLOCK_K=bk, num_stages=st, num_warps=w) for bn, bk, st, w in
            [(16, 128, 4, 4), (32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 3, 4), (16, 64, 6, 4), (32, 64, 5, 2)]]


class Bench:
    def __init__(self, args, torch):
        self.args, self.torch = args, torch
        self.t0 = time.time()
        self.results = []
        gemv = _load("_bench_gemv", os.path.join(ROOT, "benchmarks", "gemv_sweep.py"))
        self.time_graph, self.time_events = gemv.time_graph, gemv.time_events

    @property
    def over(self):
        return time.time() - self.t0 > self.args.budget_s

    def record(self, rec, fn, args_list, check, nbytes=None, graph=True):
        """Check (a float error, or a dict of them), then time fn over args_list; print a line."""
        try:
            rec.update(check())
            if not self.args.smoke:
                rec["us"] = (self.time_graph if graph else self.time_events)(fn, args_list, self.torch)
                rec["timing"] = "graph" if graph else "events"
                if nbytes:
                    rec["gbps"] = nbytes / rec["us"] / 1e3
                    rec["frac_peak"] = nbytes / (rec["us"] * 1e-6) / PEAK
        except Exception as e:  # a config that does not compile / fit: report, go on
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        self.results.append(rec)
        errs = "  ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in rec.items() if k.startswith("err") or k.startswith("mismatch"))
        timing = f"  {rec['us']:8.1f} us" + (f"  {rec['gbps']:6.0f} GB/s" if "gbps" in rec else "") \
            if "us" in rec else ""
        print(f"{rec['section']:8s}{rec['model']:15s}T={rec['T']:<4d}{rec['variant']:34s}"
              + (f"ERROR {rec['error']}" if "error" in rec else errs + timing), flush=True)
        self.write_json()
        return rec

    def write_json(self, summary=None):
        out = os.environ.get("OUT")
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "moe_bench.json"), "w") as f:
                json.dump({"peak_Bps": PEAK, "results": self.results, "summary": summary}, f, indent=1)


def rel_err(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def routing_check(got, want):
    """Rows whose id sets differ, and the weight error (sorted by id) on the others."""
    (gw, gi), (ww, wi) = got, want
    go, wo = gi.long().argsort(-1), wi.long().argsort(-1)
    gi, wi, gw, ww = gi.long().gather(1, go), wi.long().gather(1, wo), gw.gather(1, go), ww.gather(1, wo)
    same = (gi == wi).all(-1)
    err = (gw[same] - ww[same]).abs().max().item() if same.any() else 0.0
    return {"mismatch_rows": int((~same).sum().item()), "err_w": err}


def bench_router_and_routing(b, dev, dt, ts):
    torch = b.torch
    from blitzllm.kernels.moe.router import (reference_router_gemm, reference_select_experts, router_config,
                                      router_gemm_triton, select_experts_triton)
    from blitzllm.kernels._common import device_sms
    for model, (h, e, k, scoring, with_bias, ng, tg, renorm, scaling) in MODELS.items():
        if b.args.smoke:
            h, e = 96, 16 if ng == 1 else 32
        w_bytes = e * h * dt.itemsize
        copies = 1 if b.args.smoke else max(2, math.ceil(MIN_BYTES / w_bytes))
        ws = [torch.randn(e, h, device=dev, dtype=dt) * h ** -0.5 for _ in range(copies)]
        bias = torch.rand(e, device=dev) * 0.1 if with_bias else None
        route = (k, scoring, bias, ng, tg, renorm, scaling)
        for t in ts:
            x = torch.randn(t, h, device=dev, dtype=dt)
            base = dict(model=model, T=t, E=e, H=h)
            ref = reference_router_gemm(x, ws[0])
            nbytes = w_bytes + x.numel() * dt.itemsize + t * e * 4
            b.record(dict(base, section="router", variant="torch"), lambda w: (x @ w.t()).float(), ws,
                     lambda: {"err": rel_err((x @ ws[0].t()).float(), ref)}, nbytes)
            seen = set()
            for name, cfg in [("heuristic", None)] + ([] if b.over else
                                                     [(f"sweep{i}", c) for i, c in enumerate(router_sweep(t))]):
                full = router_config(t, e, h, dt, dt, device_sms(x), cfg)
                key = tuple(sorted(full.items()))
                if key in seen:
                    continue
                seen.add(key)
                label = (f"{'dot' if full['DOT'] else 'fma'} e{full['BLOCK_E']} h{full['BLOCK_H']} "
                         f"s{full['SPLIT_H']} w{full['num_warps']}")
                b.record(dict(base, section="router", variant=name, label=label, config=full),
                         lambda w, cfg=cfg: router_gemm_triton(x, w, config=cfg), ws,
                         lambda cfg=cfg: {"err": max(rel_err(router_gemm_triton(x, ws[0], config=cfg), ref)
                                                     for _ in range(2))}, nbytes)
            logits = router_gemm_triton(x, ws[0])
            want = reference_select_experts(logits, *route)
            b.record(dict(base, section="select", variant="torch"), lambda w: reference_select_experts(logits, *route),
                     ws[:1], lambda: {})
            b.record(dict(base, section="select", variant="triton"), lambda w: select_experts_triton(logits, *route),
                     ws[:1], lambda: routing_check(select_experts_triton(logits, *route), want))
            b.record(dict(base, section="gate", variant="torch"),
                     lambda w: reference_select_experts((x @ w.t()).float(), *route), ws, lambda: {}, nbytes)
            b.record(dict(base, section="gate", variant="triton"),
                     lambda w: select_experts_triton(router_gemm_triton(x, w), *route), ws,
                     lambda: routing_check(select_experts_triton(router_gemm_triton(x, ws[0]), *route),
                                           reference_select_experts(reference_router_gemm(x, ws[0]), *route)), nbytes)
        ws.clear()


def bench_fused_moe(b, dev, dt, ts):
    torch = b.torch
    from blitzllm.kernels.moe.experts import fused_moe_triton, moe_config
    from blitzllm.kernels.moe.router import reference_fused_moe, reference_select_experts
    from blitzllm.kernels._common import device_sms
    e, k, h, inter = (8, 2, 64, 40) if b.args.smoke else QWEN_MOE
    w13 = torch.randn(e, 2 * inter, h, device=dev, dtype=dt) * h ** -0.5
    w2 = torch.randn(e, h, inter, device=dev, dtype=dt) * inter ** -0.5
    expert_bytes = 3 * h * inter * dt.itemsize
    for t in ts:
        calls = []
        for _ in range(1 if b.args.smoke else ROUTINGS):
            x = torch.randn(t, h, device=dev, dtype=dt)
            tw, ids = reference_select_experts(torch.randn(t, e, device=dev), k)
            calls.append((x, tw, ids))
        chosen = sum(torch.unique(ids).numel() for _, _, ids in calls) / len(calls)
        nbytes = chosen * expert_bytes + 2 * t * h * dt.itemsize
        base = dict(model="qwen3-30b-a3b", T=t, E=e, K=k, H=h, I=inter, chosen_experts=chosen)
        x0, tw0, ids0 = calls[0]
        ref = reference_fused_moe(x0, w13, w2, tw0, ids0)
        b.record(dict(base, section="moe", variant="reference"),
                 lambda c: reference_fused_moe(*_moe_args(c, w13, w2)), calls, lambda: {}, nbytes, graph=False)
        variants = [("heuristic", None)]
        if t <= 16 and not b.over:
            variants += [(f"sweep{i}", c) for i, c in enumerate(moe_sweep())]
        seen = set()
        for name, cfg in variants:
            full = moe_config(t, k, e, h, inter, dt, device_sms(x0), cfg)
            key = str(full)
            if key in seen:
                continue
            seen.add(key)
            label = " | ".join(f"m{c['BLOCK_M']} n{c['BLOCK_N']} k{c['BLOCK_K']} w{c['num_warps']} st{c['num_stages']}"
                               for c in full)
            rec = dict(base, section="moe", variant=name, label=label, config=full)
            b.record(rec, lambda c, cfg=cfg: fused_moe_triton(*_moe_args(c, w13, w2), config=cfg), calls,
                     lambda cfg=cfg: {"err": rel_err(fused_moe_triton(x0, w13, w2, tw0, ids0, config=cfg), ref)},
                     nbytes)
            if name == "heuristic" and not b.args.smoke:  # eager too: the launch overhead a graph hides
                ev = dict(rec, variant="heuristic-eager")
                ev["us"] = b.time_events(lambda c: fused_moe_triton(*_moe_args(c, w13, w2)), calls, torch)
                ev["gbps"] = nbytes / ev["us"] / 1e3
                b.results.append(ev)


def _moe_args(c, w13, w2):
    x, tw, ids = c
    return x, w13, w2, tw, ids


def summarize(results):
    """One row per (section, model, T): the baseline, the heuristic, the best Triton variant."""
    rows, keys = [], []
    for r in results:
        key = (r["section"], r["model"], r["T"])
        if key not in keys:
            keys.append(key)
    for key in keys:
        rs = [r for r in results if (r["section"], r["model"], r["T"]) == key and "us" in r]
        base = next((r for r in rs if r["variant"] in ("torch", "reference")), None)
        ours = [r for r in rs if r["variant"] not in ("torch", "reference", "heuristic-eager")
                and r.get("err", 0) <= 5e-2 and not r.get("mismatch_rows")]
        heur = next((r for r in ours if r["variant"] in ("heuristic", "triton")), None)
        best = min(ours, key=lambda r: r["us"]) if ours else None
        eager = next((r["us"] for r in rs if r["variant"] == "heuristic-eager"), None)
        errs = [r[k] for r in results if (r["section"], r["model"], r["T"]) == key
                and r["variant"] not in ("torch", "reference") for k in ("err", "err_w") if k in r]
        best = best or {}
        rows.append(dict(section=key[0], model=key[1], T=key[2], base_us=base and base["us"],
                         heur_us=heur and heur["us"], best_us=best.get("us"), best=best.get("label", "-"),
                         speedup=base["us"] / heur["us"] if base and heur else None,
                         best_gbps=best.get("gbps"), eager_us=eager, max_err=max(errs) if errs else None,
                         mismatch_rows=sum(r.get("mismatch_rows", 0) for r in rs)))
    return rows


def print_summary(summary, seconds):
    """Two compact tables: router / routing / whole gate per (model, T), then fused experts."""
    f = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    get = {(s["section"], s["model"], s["T"]): s for s in summary}
    print(f"\n== summary ({seconds:.0f} s; bf16; us per call, CUDA-graph replay; x = torch / Triton heuristic)")
    print(f"{'model':14s}{'T':>3s} | {'router torch':>12s} {'triton':>7s} {'best':>6s} {'x':>5s} | "
          f"{'select torch':>12s} {'triton':>7s} {'x':>5s} | {'gate torch':>10s} {'triton':>7s} {'x':>5s} | "
          f"{'max err':>7s} {'mism':>4s}")
    for (section, model, t), r in get.items():
        if section != "router":
            continue
        sel, gate = get.get(("select", model, t), {}), get.get(("gate", model, t), {})
        errs = [v for v in (r["max_err"], sel.get("max_err"), gate.get("max_err")) if v is not None]
        print(f"{model:14s}{t:3d} | {f(r['base_us']):>12s} {f(r['heur_us']):>7s} {f(r['best_us']):>6s} "
              f"{f(r['speedup'], 2):>5s} | {f(sel.get('base_us')):>12s} {f(sel.get('heur_us')):>7s} "
              f"{f(sel.get('speedup'), 2):>5s} | {f(gate.get('base_us')):>10s} {f(gate.get('heur_us')):>7s} "
              f"{f(gate.get('speedup'), 2):>5s} | {max(errs) if errs else float('nan'):7.1e} "
              f"{sel.get('mismatch_rows', 0) + gate.get('mismatch_rows', 0):4d}")
    print(f"{'fused experts':14s}{'T':>3s} | {'reference':>9s} {'triton':>7s} {'eager':>7s} {'best':>7s} {'x':>6s} "
          f"{'GB/s':>5s} {'max err':>7s}  best config (gate/up | down)")
    for (section, model, t), r in get.items():
        if section == "moe":
            print(f"{model:14s}{t:3d} | {f(r['base_us']):>9s} {f(r['heur_us']):>7s} {f(r['eager_us']):>7s} "
                  f"{f(r['best_us']):>7s} "
                  f"{f(r['speedup'], 1):>6s} {f(r['best_gbps'], 0):>5s} "
                  f"{'-' if r['max_err'] is None else format(r['max_err'], '.1e'):>7s}  {r['best']}")
    print("(fused experts: the reference is timed eagerly (it syncs the host), 'eager' = Triton timed so too; "
          "GB/s = chosen experts' weights / best time; mism = rows whose experts differ)")


def run(args):
    import torch
    dev = "cpu" if args.smoke else "cuda"
    dt = torch.bfloat16
    torch.manual_seed(0)
    b = Bench(args, torch)
    ts = [int(v) for v in args.ts.split(",")]
    bench_router_and_routing(b, dev, dt, ts)
    bench_fused_moe(b, dev, dt, [int(v) for v in args.moe_ts.split(",")])
    summary = summarize(b.results)
    b.write_json(summary)
    print_summary(summary, time.time() - b.t0)
    tol = 5e-2 if args.smoke else 2e-2  # (the interpreter rounds to bf16 toward zero)
    bad = [r for r in b.results if "error" in r or r.get("err", 0) > tol or r.get("mismatch_rows")]
    print(f"{len(bad)} variant(s) failed, exceeded {tol:g} relative error or chose other experts")
    return 1 if bad else 0


def use_interpreter(args):
    """--smoke: small token counts, and Triton's interpreter on CPU tensors with the fixes the
    kernel tests apply (runtime loop bounds, bf16 tl.dot); before triton is imported."""
    if args.ts == "1,4,16":
        args.ts = "1,3"
    if args.moe_ts == "1,16,256":
        args.moe_ts = "1,5"
    os.environ["TRITON_INTERPRET"] = "1"
    _load("_kernel_conftest", os.path.join(ROOT, "tests", "kernels", "conftest.py"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU check under the Triton interpreter, no timing")
    ap.add_argument("--ts", default="1,4,16", help="tokens for the router / routing benchmarks")
    ap.add_argument("--moe-ts", default="1,16,256", help="tokens for the fused-experts benchmark")
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="after this many seconds only the baselines and the heuristics are timed")
    args = ap.parse_args()
    if args.smoke:
        use_interpreter(args)
    sys.exit(run(args))


if __name__ == "__main__":
    main()
