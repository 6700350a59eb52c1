#!/usr/bin/env python3
"""Decode attention micro-benchmark (H200): the fused decode kernel per layer, alone and
followed by the o_proj GEMV, through CUDA graph replays of a whole model's layers.

    python3 benchmarks/decode_attention.py [--layers 32] [--contexts 384,2048] [--reps 50]

Each case captures, per layer, a fused decode attention launch (q/k norm + rotary + cache
write + split-K attention) over that layer's own paged cache, optionally followed by the
o_proj GEMV on that layer's own weight (so the GEMV reads its weight from HBM), and reports
microseconds per layer:
  attn           the attention kernel alone (PDL between consecutive launches)
  attn+o         attention then the o_proj GEMV
  o only         the GEMV alone (its weight from HBM)
Variants (``VARIANTS``): split counts, keys per tile, warps per program. First (unless
--no-l2) a check of whether a GEMV reads faster once its weight was bulk-prefetched into L2.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

SHAPES = {  # name: (Hq, Hkv, D, hidden, qk norm)
    "llama-3.1-8b": (32, 8, 128, 4096, False),
    "qwen3-0.6b": (16, 8, 128, 1024, True),
    "qwen3-30b-a3b": (32, 4, 128, 2048, True),
}


def build(name, layers, ctx, bs=16):
    hq, hkv, d, hidden, norm = SHAPES[name]
    dev, dt = "cuda", torch.bfloat16
    nblk = (ctx + bs) // bs + 1
    caches = [(torch.randn(nblk, bs, hkv, d, device=dev, dtype=dt), torch.randn(nblk, bs, hkv, d, device=dev, dtype=dt))
              for _ in range(layers)]
    tables = torch.arange(nblk, device=dev, dtype=torch.int32)[None]
    seq = torch.tensor([ctx], device=dev, dtype=torch.int32)
    pos = (seq - 1).long()
    slots = pos.clone()
    qkv = [torch.randn(1, (hq + 2 * hkv) * d, device=dev, dtype=dt) for _ in range(layers)]
    rot = d
    inv = 1.0 / 10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    f = torch.arange(ctx + 16, dtype=torch.float32)[:, None] * inv[None, :]
    cs = torch.cat([f.cos(), f.sin()], -1).to(dev)
    qw = kw = torch.ones(d, device=dev, dtype=dt) if norm else None
    wo = [torch.randn(hidden, hq * d, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
    return dict(caches=caches, tables=tables, seq=seq, pos=pos, slots=slots, qkv=qkv, cs=cs, qw=qw, kw=kw, wo=wo,
                hq=hq, hkv=hkv, d=d)


def step(s, i, with_o, splits, block_n=None, warps=None):
    from blitzllm.kernels.gemv.gemv import gemv_triton
    from blitzllm.kernels.attention.paged import fused_decode_attention_triton
    kc, vc = s["caches"][i]
    out = fused_decode_attention_triton(s["qkv"][i], s["pos"], s["cs"], s["hq"], s["hkv"], s["d"], kc, vc, s["slots"],
                                        s["tables"], s["seq"], s["d"] ** -0.5, s["qw"], s["kw"], 1e-6, s["d"],
                                        num_splits=splits, block_n=block_n, num_warps=warps)
    if with_o:
        return gemv_triton(out.reshape(1, -1), s["wo"][i])
    return out


def o_only(s, i):
    from blitzllm.kernels.gemv.gemv import gemv_triton
    return gemv_triton(s["qkv"][i][:, :s["hq"] * s["d"]], s["wo"][i])


def time_graph(fn, layers, reps):
    for i in range(layers):  # warm-up: compile, workspaces
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(layers):
            fn(i)
    return replay_us(g, reps) / layers


def replay_us(g, reps: int, warmup: int = 3) -> float:
    """Microseconds per replay of the CUDA graph ``g`` (after ``warmup`` replays)."""
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / reps


def l2_residency(reps=30):
    """Does a GEMV read faster once its weight was bulk-prefetched into L2? CUDA graphs of
    [flush the L2, (prefetch W), spin ~20 us, (GEMV)] per weight shape; the GEMV's time is
    the graph with it less the graph without it, cold and after the prefetch (microseconds)."""
    import triton
    import triton.language as tl
    from blitzllm.kernels._common import L2_PREFETCH_LANES, l2_prefetch, l2_prefetch_chunk
    from blitzllm.kernels.gemv.gemv import gemv_triton

    @triton.jit
    def _pf_kernel(w_ptr, n, chunk, LANES: tl.constexpr):
        l2_prefetch(w_ptr, n, chunk, tl.program_id(0), tl.num_programs(0), LANES)

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    out = []
    for n, k in ((4096, 4096), (1024, 2048), (4096, 1024)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nb, progs = w.numel() * 2, 132
        chunk = l2_prefetch_chunk(nb, progs)

        def seq(pf, gemv):
            flush.add_(1)
            if pf:
                _pf_kernel[(progs,)](w, nb, chunk, LANES=L2_PREFETCH_LANES)
            torch.cuda._sleep(40000)
            if gemv:
                gemv_triton(x, w)

        t = {}
        for pf in (False, True):
            for gemv in (False, True):
                seq(pf, gemv)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(10):
                        seq(pf, gemv)
                t[pf, gemv] = replay_us(g, reps, warmup=1) / 10
        cold, warm = t[False, True] - t[False, False], t[True, True] - t[True, False]
        ptx = "".join(kk.asm.get("ptx", "") for c in _pf_kernel.device_caches.values() for kk in c[0].values())
        print(f"gemv {n}x{k} ({nb / 1e6:.1f} MB): cold {cold:.2f} us, after L2 prefetch {warm:.2f} us "
              f"(prefetch in PTX: {'cp.async.bulk.prefetch.L2' in ptx})", flush=True)
        out.append((n, k, cold, warm))
    return out


# (num_splits, BLOCK_N, warps): None = the launcher's default
VARIANTS = [(None, None, None), (8, None, None), (None, 32, None), (None, 128, None), (None, None, 2),
            (None, 32, 2), (None, None, 8)]
# --splits-sweep: split counts at the default tile and warps, and 16-key tiles
SPLIT_VARIANTS = [(None, None, None), (1, None, None), (2, None, None), (4, None, None), (8, None, None),
                  (16, None, None), (None, 16, None), (None, 64, None), (None, None, 8), (None, 16, 2)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--contexts", default="384,2048")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--only-l2", action="store_true")
    ap.add_argument("--models", default=",".join(SHAPES), help="comma-separated SHAPES keys")
    ap.add_argument("--no-l2", action="store_true", help="skip the L2 residency check")
    ap.add_argument("--splits-sweep", action="store_true", help="SPLIT_VARIANTS instead of VARIANTS")
    a = ap.parse_args()
    if not a.no_l2:
        l2_residency()
    if a.only_l2:
        return
    rows = []
    for name in a.models.split(","):
        for ctx in [int(c) for c in a.contexts.split(",")]:
            s = build(name, a.layers, ctx)
            for splits, bn, warps in (SPLIT_VARIANTS if a.splits_sweep else VARIANTS):
                t_a = time_graph(lambda i: step(s, i, False, splits, bn, warps), a.layers, a.reps)
                t_ao = time_graph(lambda i: step(s, i, True, splits, bn, warps), a.layers, a.reps)
                rows.append((name, ctx, f"{bn or 32}/{warps or 'auto'}", splits or "auto", t_a, t_ao))
            t_o = time_graph(lambda i: o_only(s, i), a.layers, a.reps)
            rows.append((name, ctx, "-", "o only", t_o, float("nan")))
            del s
            torch.cuda.empty_cache()
    print(f"{'model':<14}{'ctx':>6} {'bn/warp':>7} {'splits':>7} {'attn us':>8} {'attn+o':>8}")
    for r in rows:
        print(f"{r[0]:<14}{r[1]:>6} {str(r[2]):>7} {str(r[3]):>7} {r[4]:8.2f} {r[5]:8.2f}")


if __name__ == "__main__":
    main()
