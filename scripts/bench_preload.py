#!/usr/bin/env python3
"""Can a GEMV hide its weight stream behind the latency-bound kernel before it by loading
its whole weight slice into registers before its PDL wait?

    python3 scripts/bench_preload.py [--spin-us 5]

Per unit (qwen3-30b-a3b shapes, bf16; eight weight sets cycled so nothing stays in the L2):
a 75 MB read (the experts' stream), a one-program kernel that lets its dependents launch at
once and then keeps busy for --spin-us (the decode attention), then the GEMV launched with
PDL: ``gemv_triton`` (its first weight tile before the wait) or the preload form (program p
loads rows [p*BN, +BN) x all of K into registers, waits, then multiplies by x). Checks the
preload GEMV against torch, prints us per unit (CUDA-graph replays) and each form's saving.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spin-us", type=float, default=5.0)
    ap.add_argument("--units", type=int, default=48)
    a = ap.parse_args()
    import torch
    import triton
    import triton.language as tl

    import decode_window

    from blitzllm.kernels.gemv.gemv import gemv_triton

    @triton.jit
    def preload_gemv(x_ptr, w_ptr, out_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr,
                     USE_PDL: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        BK: tl.constexpr = K // CH
        c = tl.arange(0, CH)[:, None, None]
        k = tl.arange(0, BK)[None, None, :]
        r = rows.to(tl.int64)[None, :, None]
        w = tl.load(w_ptr + r * K + c * BK + k, mask=r < N, other=0.0)  # [CH, BN, BK], all of the slice
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptr + c * BK + k)  # [CH, 1, BK]
        acc = tl.sum(tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=2), axis=0)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=rows < N)

    dev = torch.device("cuda")
    cycles = int(a.spin_us * 1980)
    H, NQ, NO = 2048, 5120, 4096
    big_n = 75 * 2 ** 20 // 2
    sets = [dict(big=torch.randn(big_n, device=dev, dtype=torch.bfloat16),
                 wo=torch.randn(H, NO, device=dev, dtype=torch.bfloat16) * 0.02,
                 wq=torch.randn(NQ, H, device=dev, dtype=torch.bfloat16) * 0.02) for _ in range(8)]
    xo = torch.randn(1, NO, device=dev, dtype=torch.bfloat16)
    xq = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    sink = torch.zeros(4096, device=dev, dtype=torch.float32)
    spin_out = torch.zeros(1, device=dev, dtype=torch.int32)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    def pre(x, w, bn, ch, warps, pdl=True):
        n, k = w.shape
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        pre.last = preload_gemv[(triton.cdiv(n, bn),)](x, w, out, n, K=k, BLOCK_N=bn, CH=ch, USE_PDL=pdl, num_warps=warps,
                                             **({"launch_pdl": True} if pdl else {}))
        return out

    for (x, key) in ((xo, "wo"), (xq, "wq")):
        w = sets[0][key]
        ref = (x.float() @ w.float().t())
        for bn, ch, warps in ((16, 8, 8), (32, 8, 8)):
            got = pre(x, w, bn, ch, warps, pdl=False).float()
            err = (got - ref).abs().max().item() / ref.abs().max().item()
            k = pre.last
            print(f"check {key} bn{bn} ch{ch} w{warps}: rel err {err:.2e} regs {getattr(k, 'n_regs', '?')} "
                  f"spills {getattr(k, 'n_spills', '?')}", flush=True)
            assert err < 2e-2

    def unit(s, form, early=True):
        decode_window.stream_kernel[(2 * sms,)](s["big"], sink, big_n, BLOCK=2048, num_warps=8)
        decode_window.spin_kernel[(1,)](spin_out, cycles, EARLY=early, num_warps=1)
        x, w = (xo, s["wo"]) if form[0] == "o" else (xq, s["wq"])
        if form[1] == "gemv":
            gemv_triton(x, w)
        else:
            _, _, bn, ch, warps = form
            pre(x, w, bn, ch, warps)

    def time_units(fn):
        return decode_window.time_units(fn, sets, a.units)

    rows = []
    for early in (True, False):
        for mat, bns in (("o", (16, 32)), ("q", (32, 64))):
            base = time_units(lambda s: unit(s, (mat, "gemv"), early))
            rows.append((f"{mat} gemv_triton early={early}", base, ""))
            for bn in bns:
                for ch, warps in ((8, 8), (16, 16)):
                    try:
                        us = time_units(lambda s: unit(s, (mat, "pre", bn, ch, warps), early))
                        rows.append((f"{mat} preload bn{bn} ch{ch} w{warps} early={early}", us, f"{base - us:+.2f}"))
                    except Exception as e:  # noqa: BLE001 (a config that does not compile)
                        rows.append((f"{mat} preload bn{bn} ch{ch} w{warps} early={early}", float("nan"),
                                     type(e).__name__))
                    print(rows[-1], flush=True)
    print(f"\nspin {a.spin_us} us; o_proj {H * NO * 2 / 4.28e12 * 1e6:.2f} us, qkv {NQ * H * 2 / 4.28e12 * 1e6:.2f} us "
          "at 4.28 TB/s")
    for name, us, d in rows:
        print(f"{name:44s} {us:8.2f} {d}")


if __name__ == "__main__":
    main()
