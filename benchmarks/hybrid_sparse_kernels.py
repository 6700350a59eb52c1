#!/usr/bin/env python3
"""Decode kernels of the hybrid (GDN) and sparse-attention (DeepSeek-V3.2) families, timed by
replaying CUDA graphs of back-to-back calls.

    python3 benchmarks/hybrid_sparse_kernels.py [gdn] [topk] [--batches 1,8,32]

gdn: at Qwen3-Next-80B and Qwen3.5-397B GDN shapes, per layer and batch size,
  - post-conv: our one-launch ``post_conv_decode_triton`` against the launches it replaces:
    (a) the torch reference ops (``reference_post_conv_decode``) and (b) fla-core's
    ``causal_conv1d_update`` + its ``l2norm`` of q and k + the torch gates;
  - recurrent: ``kernels.gdn.gated_delta_rule_decode`` (our in-place kernel on pool slots)
    against fla-core's fused recurrent kernel between a slot gather and scatter (the form the
    engine ran before) and on dense states alone, and the time to read + write the states once
    at the measured copy bandwidth.
topk: ``topk_triton`` against ``torch.topk`` on the masked row (k = 2048, fp32 logits) at rows of
  4K, 32K and 128K, and 4K in a 128K-wide graph; one row (batch-1 decode) and 8.
Prints a line per timing and writes $OUT/hybrid_sparse_kernels.json when OUT is set.
"""
import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402

import gemv_sweep  # noqa: E402
from blitzllm.bench.roofline import copy_bandwidth  # noqa: E402

# (name, Hk, Hv, dk, dv, conv kernel): the presets' linear-attention shapes
GDN_SHAPES = [("qwen3-next-80b", 16, 32, 128, 128, 4), ("qwen3.5-397b", 16, 64, 128, 128, 4)]


def time_graph(fn):
    """us per call of ``fn`` (no arguments): gemv_sweep.py's replays of a graph of 20 calls."""
    return gemv_sweep.time_graph(lambda _w: fn(), [None], torch)


def bench_gdn(batches, rows, bw):
    from fla.modules.causal_conv1d.ops import causal_conv1d_update
    from fla.modules.norm.l2norm import l2norm
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent

    from blitzllm.kernels import gdn as ops
    from blitzllm.kernels.gdn.post_conv import post_conv_decode_triton
    dev, dt = "cuda", torch.bfloat16
    for name, hk, hv, dk, dv, kw in GDN_SHAPES:
        C = 2 * hk * dk + hv * dv
        for B in batches:
            slots_n = 4 * B + 8
            x = torch.randn(B, C, device=dev, dtype=dt)
            a = torch.randn(B, hv, device=dev, dtype=dt)
            b = torch.randn(B, hv, device=dev, dtype=dt)
            conv_state = torch.randn(slots_n, kw - 1, C, device=dev, dtype=dt)
            slots = torch.randperm(slots_n, device=dev)[:B].to(torch.int32)
            w = torch.randn(C, kw, device=dev, dtype=dt) * 0.3
            A_log = torch.randn(hv, device=dev)
            dt_bias = torch.randn(hv, device=dev)
            fla_cache = torch.randn(B, C, kw, device=dev, dtype=dt)

            def fused():
                post_conv_decode_triton(x, a, b, conv_state, slots, w, None, A_log, dt_bias, hk, dk, hv, dv)

            def torch_ops():
                ops.reference_post_conv_decode(x, a, b, conv_state, slots, w, None, A_log, dt_bias, hk, dk, hv, dv)

            def fla_unfused():
                y, _ = causal_conv1d_update(x, fla_cache, weight=w, activation="silu")
                q, k, _v = y.split([hk * dk, hk * dk, hv * dv], -1)
                l2norm(q.reshape(B, hk, dk))
                l2norm(k.reshape(B, hk, dk))
                ops.reference_gdn_gates(a, b, A_log, dt_bias)

            r = dict(part="post_conv", shape=name, batch=B, us_fused=time_graph(fused),
                     us_torch_ops=time_graph(torch_ops), us_fla_unfused=time_graph(fla_unfused))
            r["speedup_vs_torch_ops"] = r["us_torch_ops"] / r["us_fused"]
            r["speedup_vs_fla_unfused"] = r["us_fla_unfused"] / r["us_fused"]
            rows.append(r)
            print(json.dumps(r), flush=True)

            # recurrent rule: states [slots, Hv, dk, dv] fp32, as the engine keeps them
            q, k, v, g, beta = post_conv_decode_triton(x, a, b, conv_state, slots, w, None, A_log, dt_bias,
                                                       hk, dk, hv, dv)
            state = torch.randn(slots_n, hv, dk, dv, device=dev) * 0.01
            gathered = state.index_select(0, slots.long())

            def engine_decode():
                ops.gated_delta_rule_decode(q, k, v, g, beta, state, slots)

            def fla_alone():
                fla_recurrent(q=q[:, None], k=k[:, None], v=v[:, None], g=g[:, None], beta=beta[:, None],
                    initial_state=gathered, output_final_state=True)

            def gather_fla_scatter():  # fla on pool slots: the form the engine ran before recurrent.py
                idx = slots.long()
                _, fin = fla_recurrent(q=q[:, None], k=k[:, None], v=v[:, None], g=g[:, None], beta=beta[:, None],
                                       initial_state=state.index_select(0, idx), output_final_state=True)
                state.index_copy_(0, idx, fin)

            state_bytes = 2 * B * hv * dk * dv * 4
            r = dict(part="recurrent", shape=name, batch=B, us_engine=time_graph(engine_decode),
                     us_fla_dense=time_graph(fla_alone), us_gather_fla_scatter=time_graph(gather_fla_scatter),
                     us_state_floor=state_bytes / bw * 1e6)
            r["engine_vs_floor"] = r["us_state_floor"] / r["us_engine"]
            r["fla_dense_vs_floor"] = r["us_state_floor"] / r["us_fla_dense"]
            r["speedup_vs_gather_fla_scatter"] = r["us_gather_fla_scatter"] / r["us_engine"]
            rows.append(r)
            print(json.dumps(r), flush=True)


def bench_topk(rows, chunks=()):
    from blitzllm.kernels.attention.topk import topk_triton
    k = 2048
    # (row length, logits width): the width is what a CUDA graph captured (the longest context);
    # the last case is a short row in a 128K-wide graph.
    for n, width in ((4096, 4096), (32768, 32768), (131072, 131072), (4096, 131072)):
        for T in (1, 8):
            logits = torch.randn(T, width, device="cuda")
            lens = torch.full((T,), n, dtype=torch.int32, device="cuda")
            cols = torch.arange(width, device="cuda")

            def ours():
                topk_triton(logits, lens, k)

            def torch_topk():  # the masked row, as an engine without its own kernel would do it
                x = logits.masked_fill(cols[None, :] >= lens[:, None], float("-inf"))
                torch.topk(x, k, dim=-1, sorted=False)

            r = dict(part="topk", row=n, width=width, rows=T, k=k, us_triton=time_graph(ours),
                     us_torch=time_graph(torch_topk))
            for c in chunks:  # other spans of the long rows' programs
                r[f"us_triton_chunk{c}"] = time_graph(lambda: topk_triton(logits, lens, k, chunk=c))
            r["speedup_vs_torch"] = r["us_torch"] / r["us_triton"]
            rows.append(r)
            print(json.dumps(r), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="*", default=["gdn", "topk"], choices=["gdn", "topk"])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--topk-chunks", default="", help="also time top-k with these chunk widths, e.g. 1024,2048")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("hybrid_sparse_kernels.py times CUDA kernels: no CUDA device here")
    rows = []
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s on {torch.cuda.get_device_name()}", flush=True)
    if "gdn" in args.parts:
        bench_gdn([int(b) for b in args.batches.split(",")], rows, bw)
    if "topk" in args.parts:
        bench_topk(rows, [int(c) for c in args.topk_chunks.split(",") if c])
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "hybrid_sparse_kernels.json"), "w") as f:
            json.dump(dict(copy_bandwidth_Bps=bw, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))


if __name__ == "__main__":
    main()
