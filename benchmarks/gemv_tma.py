#!/usr/bin/env python3
"""The TMA GEMV (kernels/gemv/gemv_tma.py) against the FMA GEMV (kernels/gemv/gemv.py) on decode shapes.

    python3 benchmarks/gemv_tma.py [--spin-us 5] [--units 48]

Checks the TMA GEMV against torch (1-2 rows, bias, a small shared-memory budget so its ring
turns), then per shape (bf16; weight sets cycled so nothing stays in the L2) times, as CUDA-graph
replays: each GEMV alone, launched back to back with PDL, and each behind a one-program kernel
that keeps busy for --spin-us and lets its dependents launch as it starts (the decode attention
before o_proj). Prints us per unit, the weight stream's rate, and what hides behind the spin.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {  # name: (N, K)
    "q30b_o_proj": (2048, 4096), "q30b_qkv": (5120, 2048), "q06_o_proj": (1024, 2048), "q06_qkv": (4096, 1024),
    "llama_o_proj": (4096, 4096), "llama_qkv": (6144, 4096), "q30b_lm_head": (151936, 2048),
}
if os.environ.get("SHAPES"):
    SHAPES = {k: SHAPES[k] for k in os.environ["SHAPES"].split(",")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spin-us", type=float, default=5.0)
    ap.add_argument("--units", type=int, default=48)
    a = ap.parse_args()
    import torch

    import decode_window
    from blitzllm.kernels.gemv import gemv_tma
    from blitzllm.kernels.gemv.gemv import gemv_triton

    dev = torch.device("cuda")
    torch.manual_seed(0)
    bf = torch.bfloat16
    # correctness
    worst = 0.0
    for (N, K) in ((2048, 4096), (5120, 2048), (1000, 768), (37, 2056), (4096, 1024)):
        w = torch.randn(N, K, device=dev, dtype=bf)
        b = torch.randn(N, device=dev, dtype=bf)
        for M in (1, 2):
            x = torch.randn(M, K, device=dev, dtype=bf)
            for bias in (None, b):
                for cfg in (None, gemv_tma.tma_gemv_config(N, K, 2, 132, smem_bytes=1)):
                    got = gemv_tma.gemv_tma_triton(x, w, bias, config=cfg).float()
                    ref = gemv_tma.reference_gemv_tma(x, w, bias).float()
                    err = ((got - ref).abs() / (ref.abs() + 1)).max().item()
                    worst = max(worst, err)
                    assert err < 2e-2, (N, K, M, bias is not None, cfg, err)
    print(f"correctness ok (worst rel err {worst:.2e})")
    cycles = int(a.spin_us * 1.98e3)  # the H200's SM clock, 1.98 GHz (the spin column shows the real time)
    sink = torch.zeros(4, dtype=torch.int64, device=dev)
    rows = []
    for name, (N, K) in SHAPES.items():
        nbytes = N * K * 2
        sets = [(torch.randn(1, K, device=dev, dtype=bf), torch.randn(N, K, device=dev, dtype=bf))
                for _ in range(max(2, min(8, (400 << 20) // nbytes)))]
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        cfg = gemv_tma.tma_gemv_config(N, K, 2, sms)
        forms = {"fma": lambda s: gemv_triton(s[0], s[1]),
                 "tma": lambda s: gemv_tma.gemv_tma_triton(s[0], s[1], config=cfg)}
        spin_only = decode_window.time_units(lambda s: decode_window.spin_kernel[(1,)](sink, cycles, EARLY=True),
                                             sets, a.units)

        def behind(g):
            def unit(s):
                decode_window.spin_kernel[(1,)](sink, cycles, EARLY=True)
                g(s)
            return unit
        alone = {k: decode_window.time_units(f, sets, a.units) for k, f in forms.items()}
        after = {k: decode_window.time_units(behind(f), sets, a.units) for k, f in forms.items()}
        rows.append((name, nbytes / 1e6, alone, after, spin_only, cfg))
    keys = list(rows[0][2])
    print(f"{'shape':14s} {'MB':>6s} " + " ".join(f"{k + '_us':>8s}" for k in keys) + " "
          + " ".join(f"{k + '_TB/s':>9s}" for k in keys) + f" {'spin':>5s} " + " ".join(f"{'s+' + k:>8s}" for k in keys)
          + "  tma config")
    for name, mb, alone, after, spin, cfg in rows:
        print(f"{name:14s} {mb:6.1f} " + " ".join(f"{alone[k]:8.2f}" for k in keys) + " "
              + " ".join(f"{mb / alone[k]:9.2f}" for k in keys) + f" {spin:5.2f} " + " ".join(f"{after[k]:8.2f}" for k in keys)
              + f"  bn={cfg['BLOCK_N']} G={cfg['G']} progs={cfg['programs']} slots={cfg['SLOTS']}")

if __name__ == "__main__":
    main()
