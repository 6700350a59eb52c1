"""Micro-benchmarks of the Triton kernels (GPU only; not collected by pytest).

    python tests/kernels/bench_kernels.py [--quick]

Times with CUDA-graph replay (launch overhead excluded) and prints achieved
bandwidth or FLOP rates next to the torch baselines.
"""
import argparse

import torch
import triton.testing as tt

from blitzllm.kernels import activation
from blitzllm.kernels.attention import paged as pa, qk_norm_rope_cache as qk
from blitzllm.kernels.norm import rmsnorm


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return tt.do_bench_cudagraph(fn, rep=50) * 1e-3  # seconds


def make_cache(seq_lens, hkv, d, bs, dtype):
    need = [(n + bs - 1) // bs for n in seq_lens]
    nblk = sum(need) + 1
    perm = torch.randperm(nblk, device="cuda").int()
    tables = torch.zeros(len(seq_lens), max(need), dtype=torch.int32, device="cuda")
    i = 0
    for b, nb in enumerate(need):
        tables[b, :nb] = perm[i:i + nb]
        i += nb
    kc = torch.randn(nblk, bs, hkv, d, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    return kc, vc, tables, torch.tensor(seq_lens, dtype=torch.int32, device="cuda")


def bench_decode(quick):
    hq, hkv, d, dt = 32, 8, 128, torch.bfloat16
    print("decode  B  ctx     splits  us      GB/s (K+V read)")
    for b, ctx in [(1, 512), (1, 4096), (1, 32768), (8, 4096), (64, 2048), (256, 1024)]:
        if quick and ctx == 32768:
            continue
        kc, vc, tables, seq = make_cache([ctx] * b, hkv, d, 16, dt)
        q = torch.randn(b, hq, d, device="cuda", dtype=dt)
        nbytes = 2 * b * ctx * hkv * d * 2
        for s in [None, 1, 8, 32]:
            t = bench(lambda: pa.paged_decode_attention_triton(
                q, kc, vc, tables, seq, d ** -0.5, num_splits=s))
            print(f"        {b:<3}{ctx:<8}{str(s):<8}{t * 1e6:<8.1f}{nbytes / t / 1e9:.0f}")


def bench_prefill(quick):
    hq, hkv, d, dt = 32, 8, 128, torch.bfloat16
    print("prefill T     us      TFLOP/s   sdpa TFLOP/s")
    for n in [512, 2048] if quick else [512, 2048, 8192]:
        kc, vc, tables, seq = make_cache([n], hkv, d, 16, dt)
        q = torch.randn(n, hq, d, device="cuda", dtype=dt)
        qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        flops = 4 * n * n * hq * d / 2
        t = bench(lambda: pa.paged_prefill_attention_triton(
            q, kc, vc, qsl, seq, tables, d ** -0.5, n))
        k = kc[tables[0].long()].reshape(-1, hkv, d)[:n].transpose(0, 1)
        v = vc[tables[0].long()].reshape(-1, hkv, d)[:n].transpose(0, 1)
        qt = q.transpose(0, 1)
        ts = bench(lambda: torch.nn.functional.scaled_dot_product_attention(
            qt, k, v, is_causal=True, enable_gqa=True))
        print(f"        {n:<6}{t * 1e6:<8.1f}{flops / t / 1e12:<10.1f}{flops / ts / 1e12:.1f}")


def bench_small():
    dt = torch.bfloat16
    print("op                       T      us      GB/s")
    for T in [1, 4096]:
        x = torch.randn(T, 4096, device="cuda", dtype=dt)
        r = torch.randn_like(x)
        w = torch.rand(4096, device="cuda", dtype=dt)
        t = bench(lambda: rmsnorm.fused_add_rms_norm_triton(x, r, w, 1e-6))
        print(f"fused_add_rms_norm       {T:<7}{t * 1e6:<8.1f}{4 * x.numel() * 2 / t / 1e9:.0f}")
        g = torch.randn(T, 2 * 12288, device="cuda", dtype=dt)
        t = bench(lambda: activation.silu_and_mul_triton(g))
        print(f"silu_and_mul             {T:<7}{t * 1e6:<8.1f}{1.5 * g.numel() * 2 / t / 1e9:.0f}")
        hq, hkv, d = 32, 8, 128
        qkv = torch.randn(T, (hq + 2 * hkv) * d, device="cuda", dtype=dt)
        pos = torch.arange(T, device="cuda")
        inv = 1.0 / 1e6 ** (torch.arange(0, d, 2, device="cuda").float() / d)
        f = torch.arange(8192, device="cuda").float()[:, None] * inv
        cs = torch.cat([f.cos(), f.sin()], -1)
        kc = torch.empty(T // 16 + 1, 16, hkv, d, device="cuda", dtype=dt)
        vc = torch.empty_like(kc)
        slots = torch.arange(T, device="cuda")
        qw = torch.rand(d, device="cuda", dtype=dt)
        t = bench(lambda: qk.fused_qk_norm_rope_cache_triton(
            qkv, pos, cs, hq, hkv, d, kc, vc, slots, qw, qw))
        print(f"qk_norm_rope_cache       {T:<7}{t * 1e6:<8.1f}{2 * qkv.numel() * 2 / t / 1e9:.0f}")


def sweep():
    hq, hkv, d, dt = 32, 8, 128, torch.bfloat16
    print("decode sweep: B ctx | splits block_n stages early_v -> us")
    for b, ctx in [(1, 512), (1, 4096), (1, 32768), (32, 2048)]:
        kc, vc, tables, seq = make_cache([ctx] * b, hkv, d, 16, dt)
        q = torch.randn(b, hq, d, device="cuda", dtype=dt)
        res = []
        for s in ([None, 32] if b == 1 else [None, 2]):
            for bn in [32, 64, 128]:
                for st in [1, 2]:
                    for ev in [False, True]:
                        t = bench(lambda: pa.paged_decode_attention_triton(
                            q, kc, vc, tables, seq, 0.1, num_splits=s, block_n=bn,
                            num_stages=st, early_v=ev))
                        res.append((t * 1e6, s, bn, st, ev))
        res.sort(key=lambda r: r[0])
        dflt = [r for r in res if r[1] is None and r[2] == 64 and r[3] == 2 and r[4]]
        print(f"  {b} {ctx} default {dflt[0][0]:.1f}us; best:",
              "; ".join(f"{r[0]:.1f}us s={r[1]} bn={r[2]} st={r[3]} ev={r[4]}" for r in res[:4]))
    print("prefill sweep: T | block_m block_n warps stages -> TFLOP/s")
    for n in [1024, 4096]:
        kc, vc, tables, seq = make_cache([n], hkv, d, 16, dt)
        q = torch.randn(n, hq, d, device="cuda", dtype=dt)
        qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        flops = 4 * n * n * hq * d / 2
        res = []
        for bm in [64, 128]:
            for bn in [32, 64, 128]:
                for w in [4, 8]:
                    for st in [2, 3]:
                        try:
                            t = bench(lambda: pa.paged_prefill_attention_triton(
                                q, kc, vc, qsl, seq, tables, 0.1, n, block_m=bm, block_n=bn,
                                num_warps=w, num_stages=st))
                        except Exception as e:  # e.g. out of shared memory
                            print("   fail", bm, bn, w, st, type(e).__name__)
                            continue
                        res.append((flops / t / 1e12, bm, bn, w, st))
        res.sort(key=lambda r: -r[0])
        print(f"  {n}:", "; ".join(f"{r[0]:.0f} bm={r[1]} bn={r[2]} w={r[3]} st={r[4]}"
                                  for r in res[:5]))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    a = ap.parse_args()
    if a.sweep:
        sweep()
        raise SystemExit
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "SMs", torch.cuda.get_device_properties(0).multi_processor_count)
    bench_small()
    bench_decode(a.quick)
    bench_prefill(a.quick)
