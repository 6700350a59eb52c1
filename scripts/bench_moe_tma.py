#!/usr/bin/env python3
"""Batch-1 MoE experts on the GPU: the one-launch TMA MoE (kernels/moe_tma.py) against the
direct path's two grouped GEMMs (kernels/fused_moe.py), at the MoE presets' expert shapes.
Each variant runs as a CUDA graph of LAYERS launches over distinct weights (so no launch
finds its experts in the L2), PDL on as in the engine; us per launch and the chosen experts'
bytes over that time. Then one TMA launch's per-program timeline (%globaltimer).

    python3 scripts/bench_moe_tma.py [--models qwen3-30b-a3b,minimax-m2,deepseek-v3] [--tokens 1]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from blitzllm.kernels import fused_moe, moe_tma  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (2048, 768, 8), "minimax-m2": (3072, 1536, 8), "deepseek-v3": (7168, 2048, 8)}


def graph_us(fn, layers, reps=10):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(layers):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(layers):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / layers)
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-30b-a3b,minimax-m2,deepseek-v3")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--layers", default="qwen3-30b-a3b=48,minimax-m2=8,deepseek-v3=8")
    ap.add_argument("--experts", default="qwen3-30b-a3b=128,minimax-m2=32,deepseek-v3=16",
                    help="experts per layer (qwen3-30b-a3b: all 128 over 48 layers, the real 58 GB spread)")
    args = ap.parse_args()
    bf = torch.bfloat16
    rows = []
    for name in args.models.split(","):
        H, I, K = SHAPES[name]
        T = args.tokens
        E = int(dict(kv.split("=") for kv in args.experts.split(","))[name])
        L = int(dict(kv.split("=") for kv in args.layers.split(","))[name])
        g = torch.Generator(device="cuda").manual_seed(0)
        w13 = [(torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5).to(bf) for _ in range(L)]
        w2 = [(torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5).to(bf) for _ in range(L)]
        x = torch.randn(T, H, device="cuda", generator=g).to(bf)
        ids = [torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)]).to(torch.int32)
               for _ in range(L)]
        tw = torch.full((T, K), 1.0 / K, device="cuda")
        chosen = sum(len(set(i.flatten().tolist())) for i in ids) / L
        nbytes = chosen * 3 * I * H * 2
        ref = moe_tma.reference_moe_tma(x, w13[0], w2[0], tw, ids[0]).float()
        out_t = moe_tma.moe_tma_triton(x, w13[0], w2[0], tw, ids[0]).float()
        out_d = fused_moe.fused_moe_triton(x, w13[0], w2[0], tw, ids[0], direct=True).float()
        err_t = (out_t - ref).abs().max().item()
        err_d = (out_d - ref).abs().max().item()
        us_d = graph_us(lambda i: fused_moe.fused_moe_triton(x, w13[i], w2[i], tw, ids[i], direct=True), L)
        cfg = moe_tma._cached_config(T, H, I, K, 2, torch.cuda.get_device_properties(0).multi_processor_count,
                                     moe_tma.MOE_TMA_SMEM)
        line = f"{name:<14} T={T} E={E} L={L}  direct {us_d:7.2f} us ({nbytes / us_d / 1e6:5.2f} TB/s, err {err_d:.3g})"
        for c in (cfg,):
            us_t = graph_us(lambda i: moe_tma.moe_tma_triton(x, w13[i], w2[i], tw, ids[i], config=c), L)
            line += f"   tma {us_t:7.2f} us ({nbytes / us_t / 1e6:5.2f} TB/s) x{us_d / us_t:.3f}"
            # the timeline of the graph's last launch (TIMED variant, in the graph like the engine)
            times = torch.zeros(L, cfg["programs"], 8, dtype=torch.int64, device="cuda")
            graph_us(lambda i: moe_tma.moe_tma_triton(x, w13[i], w2[i], tw, ids[i], config=c, times=times[i]), L,
                     reps=2)
            t = times[L - 1, :, :len(moe_tma.TIMELINE)].double()
            t = (t - t[:, 0].min()) / 1000.0
            names = moe_tma.TIMELINE
            print(f"{name} timeline of a launch in the graph (us after its first program's start; "
                  f"min / median / max over {cfg['programs']} programs), config {c}:")
            for j, nm in enumerate(names):
                col = t[:, j]
                print(f"  {nm:<13} {col.min().item():7.2f} {col.median().item():7.2f} {col.max().item():7.2f}")
        rows.append(line + f"  (err {err_t:.3g})")
        w13 = w2 = None  # (free the weights before the next model)
        torch.cuda.empty_cache()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
