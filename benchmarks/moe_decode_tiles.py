#!/usr/bin/env python3
"""Batch-1 MoE decode launches, apart: the direct path's gate/up GEMM and its down GEMM (with
the fused weighted combine), each over a grid of tiles, beside the dense GEMV streaming the
same bytes.

    python3 benchmarks/moe_decode_tiles.py [--models qwen3-30b-a3b,...] [--t 1] [--budget-s 240]
                                           [--launches up,down]
    python3 benchmarks/moe_decode_tiles.py --smoke     # CPU: tiny shapes under TRITON_INTERPRET=1

Per model (expert sizes of Qwen3-30B-A3B, DeepSeek-V3, MiniMax-M2; bf16): T tokens with 8
different routings cycled through the captured calls (each call reads its experts from HBM),
every variant checked against the torch reference of that launch first. Timings are CUDA-graph
replays (benchmarks/gemv_sweep.py's ``time_graph``); GB/s counts the chosen experts' weights of
the launch. "dense" rows: ``gemv_glu_triton`` / ``gemv_triton`` over one matrix as large as
the launch's weights (T=1: 8 x [2I, H] and 8 x [H, I]), the heuristic tiles: what the GEMV
streams at that size. Prints a table per launch (heuristic, best five) and writes
$OUT/moe_decode.json when OUT is set.
"""
import argparse
import importlib.util
import itertools
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v3": (256, 8, 7168, 2048),
          "minimax-m2": (256, 8, 3072, 1536),
          # the hybrids with their shared expert stacked as expert 512: top-10 + 1 entries
          "qwen3-next-80b-a3b": (513, 11, 2048, 512), "qwen3.5-397b-a17b": (513, 11, 4096, 1024)}  # E, K, H, I
ROUTINGS = 8
SMEM = 200 * 1024


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def grid(gated, smoke):
    """Tile configs of one launch, those whose pipeline buffers fit the shared memory."""
    if smoke:
        return [dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2)]
    out = []
    for bn, bk, (w, st) in itertools.product((16, 32, 64, 128), (64, 128, 256),
                                             ((4, 3), (4, 4), (4, 6), (8, 4), (2, 4))):
        if st * 2 * (16 * bk + (2 if gated else 1) * bn * bk) <= SMEM:
            out.append(dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st))
    return out


def label(c):
    return f"n{c['BLOCK_N']} k{c['BLOCK_K']} w{c['num_warps']} st{c['num_stages']}"


def run(args):
    import torch
    from blitzllm.kernels.moe import experts as fm
    from blitzllm.kernels._common import device_sms
    from blitzllm.kernels.gemv.gemv import gemv_glu_triton, gemv_triton
    from blitzllm.kernels.moe.router import reference_select_experts
    gemv_bench = _load("_bench_gemv", os.path.join(ROOT, "benchmarks", "gemv_sweep.py"))
    dev = "cpu" if args.smoke else "cuda"
    dt = torch.bfloat16
    t0 = time.time()
    tol = 5e-2 if args.smoke else 2e-2  # (the interpreter rounds to bf16 toward zero)
    results = []
    torch.manual_seed(0)
    for model in args.models.split(","):
        e, k, h, inter = (8, 2, 64, 40) if args.smoke else MODELS[model]
        t = args.t
        w13 = torch.randn(e, 2 * inter, h, device=dev, dtype=dt) * h ** -0.5
        w2 = torch.randn(e, h, inter, device=dev, dtype=dt) * inter ** -0.5
        calls = []
        for _ in range(1 if args.smoke else ROUTINGS):
            x = torch.randn(t, h, device=dev, dtype=dt)
            tw, ids = reference_select_experts(torch.randn(t, e, device=dev), k)
            ids = ids.reshape(-1).to(torch.int32).contiguous()
            act = torch.randn(t * k, inter, device=dev, dtype=dt)
            calls.append((x, ids, tw.reshape(-1).float().contiguous(), act))
        chosen = sum(torch.unique(c[1]).numel() for c in calls) / len(calls)
        n = t * k
        heur = fm.moe_config(t, k, e, h, inter, dt, device_sms(w13))

        def up(c, cfg):
            x, ids, _, _ = c
            out = torch.empty(n, inter, dtype=dt, device=dev)
            fm._grouped_gemm(x, w13, out, ids, ids, ids, n, k, inter, True, dict(cfg, BLOCK_M=16), direct=True)
            return out

        def down(c, cfg):
            _, ids, tw, act = c
            y = torch.empty(n, h, dtype=dt, device=dev)
            out = torch.empty(t, h, dtype=dt, device=dev)
            fm._grouped_gemm(act, w2, y, ids, ids, ids, n, 1, h, False, dict(cfg, BLOCK_M=16), direct=True,
                             combine=(tw, out, k))
            return out

        def ref_up(c):
            x, ids, _, _ = c
            wi = w13[ids.long()].float()  # [n, 2I, H]
            g = torch.einsum("nih,nh->ni", wi, x.float().repeat_interleave(k, 0)).to(dt).float()
            gate, upv = g[:, :inter], g[:, inter:]
            return ((gate / (1 + torch.exp(-gate))).to(dt).float() * upv).to(dt)

        def ref_down(c):
            _, ids, tw, act = c
            y = torch.einsum("nhi,ni->nh", w2[ids.long()].float(), act.float()).to(dt).float()
            return (y * tw[:, None]).reshape(t, k, h).sum(1).to(dt)

        for launch, fn, ref, gated, wbytes in (("up", up, ref_up, True, 2 * inter * h * 2),
                                               ("down", down, ref_down, False, h * inter * 2)):
            if launch not in args.launches.split(","):
                continue
            want = ref(calls[0])
            nbytes = chosen * wbytes
            variants = [("heuristic", heur[0] if gated else heur[1])]
            variants += [(label(c), dict(c, BLOCK_M=16)) for c in grid(gated, args.smoke)]
            for name, cfg in variants:
                if time.time() - t0 > args.budget_s and name != "heuristic":
                    continue
                rec = dict(model=model, T=t, launch=launch, variant=name, config=cfg)

                def f(c, cfg=cfg, fn=fn):
                    return fn(c, cfg)
                try:
                    got = f(calls[0])
                    rec["err"] = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                    if not args.smoke:
                        rec["us"] = gemv_bench.time_graph(f, calls, torch)
                        rec["gbps"] = nbytes / rec["us"] / 1e3
                except Exception as ex:  # a config that does not compile / fit
                    rec["error"] = f"{type(ex).__name__}: {str(ex)[:160]}"
                results.append(rec)
                print(f"{model:14s}{launch:5s}{name:22s}" + (f"ERROR {rec['error']}" if "error" in rec else
                      f"err {rec['err']:.1e}" + (f"  {rec['us']:7.2f} us {rec['gbps']:6.0f} GB/s" if "us" in rec else "")),
                      flush=True)
            # the dense GEMV over the same bytes (heuristic tiles)
            rows = int(round(chosen)) * (2 * inter if gated else h)
            kd = h if gated else inter
            copies = 1 if args.smoke else max(2, math.ceil(200e6 / (rows * kd * 2)))
            ws = [torch.randn(rows, kd, device=dev, dtype=dt) * kd ** -0.5 for _ in range(copies)]
            xd = torch.randn(1, kd, device=dev, dtype=dt)
            g = (lambda w: gemv_glu_triton(xd, w)) if gated else (lambda w: gemv_triton(xd, w))
            rec = dict(model=model, T=t, launch=launch, variant="dense-gemv", rows=rows, K=kd)
            try:
                g(ws[0])
                if not args.smoke:
                    rec["us"] = gemv_bench.time_graph(g, ws, torch)
                    rec["gbps"] = rows * kd * 2 / rec["us"] / 1e3
            except Exception as ex:
                rec["error"] = f"{type(ex).__name__}: {str(ex)[:160]}"
            results.append(rec)
            del ws
        w13 = w2 = None  # free the experts before the next model
        if not args.smoke:
            torch.cuda.empty_cache()
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "moe_decode.json"), "w") as fh:
                json.dump(results, fh, indent=1)
    print(f"\n== summary ({time.time() - t0:.0f} s; us per launch, CUDA-graph replay; GB/s of the chosen experts' weights)")
    for model in args.models.split(","):
        for launch in args.launches.split(","):
            rs = [r for r in results if r["model"] == model and r["launch"] == launch and "us" in r
                  and r.get("err", 0) < tol]
            bad = [r for r in results if r["model"] == model and r["launch"] == launch
                   and ("error" in r or r.get("err", 0) >= tol)]
            if not rs:
                print(f"{model:14s}{launch:5s} (no timings; {len(bad)} failed)")
                continue
            pick = {r["variant"]: r for r in rs}
            line = "  ".join(f"{v} {pick[v]['us']:.2f}" for v in ("heuristic", "dense-gemv")
                             if v in pick)
            best = sorted((r for r in rs if r["variant"] not in ("dense-gemv",)), key=lambda r: r["us"])[:5]
            print(f"{model:14s}{launch:5s} {line} | best: " + ", ".join(
                f"{r['variant']} {r['us']:.2f} ({r['gbps']:.0f})" for r in best) + f" | {len(bad)} failed")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU check under the Triton interpreter, no timing")
    ap.add_argument("--models", default="qwen3-30b-a3b")
    ap.add_argument("--t", type=int, default=1, help="tokens")
    ap.add_argument("--budget-s", type=float, default=240.0, help="past this, only the heuristics are timed")
    ap.add_argument("--launches", default="up,down", help="which launches to time: up, down or both")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        _load("_kernel_conftest", os.path.join(ROOT, "tests", "kernels", "conftest.py"))
    sys.exit(run(args))


if __name__ == "__main__":
    main()
