#!/usr/bin/env python3
"""When do the programs of a PDL-launched kernel start, behind a one-program kernel that lets its
dependents launch as it starts, as a function of the shared memory each program needs?

    python3 scripts/diag_pdl_smem.py

The primary spins ~5 us and records its start and end (%globaltimer); the dependent (132 programs,
launched with PDL) records each program's start and the end of its griddepcontrol.wait. Printed,
relative to the primary's start (us): the primary's end, and the dependents' earliest / median /
latest start and wait end, per shared-memory size and with an L1-preferring kernel (the FMA GEMV)
run just before. If big-shared-memory programs start only after the primary ends, a GEMV that
streams its weights into shared memory before its wait cannot overlap the kernel before it.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def primary(out_ptr, cycles, EARLY: tl.constexpr):
    t0 = _now()
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    c0 = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    c = c0
    while c - c0 < cycles:
        c = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(out_ptr, t0)
    tl.store(out_ptr + 1, _now())


@gluon.jit
def _gnow():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def dependent(out_ptr, SMEM: gl.constexpr, EXTRA: gl.constexpr):
    pid = gl.program_id(0)
    t0 = _gnow()
    L: gl.constexpr = gl.BlockedLayout([8], [32], [4], [0])
    if SMEM > 0:
        s = gl.allocate_shared_memory(gl.int8, [SMEM], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        s.slice(0, 1024).store(gl.full([1024], 1, gl.int8, L))
    if EXTRA > 0:
        s2 = gl.allocate_shared_memory(gl.int8, [EXTRA], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        s2.slice(0, 1024).store(gl.full([1024], 1, gl.int8, L))
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    t1 = _gnow()
    v = t1 - t0
    if SMEM > 0:
        v += gl.sum(s.slice(0, 1024).load(L).to(gl.int64), axis=0) * 0
    if EXTRA > 0:
        v += gl.sum(s2.slice(0, 1024).load(L).to(gl.int64), axis=0) * 0
    gl.store(out_ptr + pid * 2, t0)
    gl.store(out_ptr + pid * 2 + 1, t0 + v)


def main():
    from blitzllm.kernels.gemv.gemv import gemv_triton
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    prim = torch.zeros(2, dtype=torch.int64, device=dev)
    dep = torch.zeros(sms, 2, dtype=torch.int64, device=dev)
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2048, 4096, device=dev, dtype=torch.bfloat16)
    print(f"{'smem_KB':>7s} {'before':>6s} {'prim_end':>8s} {'dep_start min/med/max':>24s} {'wait_end min/med/max':>24s}")
    for smem, extra in ((0, 0), (16, 0), (32, 0), (64, 0), (128, 0)):
        for before in ("none", "gemv"):
            rows = []

            def unit():
                if before == "gemv":
                    gemv_triton(x, w)
                primary[(1,)](prim, 10000, EARLY=True)
                dependent[(sms,)](dep, SMEM=smem * 1024, EXTRA=extra * 1024, num_warps=4, launch_pdl=True)
            unit()  # compile off the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                unit()
            for _ in range(5):
                g.replay()
                torch.cuda.synchronize()
                p0 = prim[0].item()
                d = (dep - p0).double() / 1e3
                s, e = d[:, 0].sort().values, d[:, 1].sort().values
                rows.append(((prim[1].item() - p0) / 1e3, s[0].item(), s[sms // 2].item(), s[-1].item(),
                             e[0].item(), e[sms // 2].item(), e[-1].item()))
            r = sorted(rows)[2]
            print(f"{smem + extra:7d} {before:>6s} {r[0]:8.2f} {r[1]:7.2f} {r[2]:7.2f} {r[3]:8.2f} {r[4]:7.2f} {r[5]:7.2f} {r[6]:8.2f}")

    tma_timeline()


def tma_timeline():
    """The TMA GEMV (o_proj / qkv shapes of qwen3-30b-a3b) behind the ~5 us primary, in a CUDA
    graph of 8 units on distinct weights: each point of its programs (kernels/gemv/gemv_tma.py
    ``times``) relative to the primary's start, us: min / median / max over programs."""
    from blitzllm.kernels.gemv.gemv_tma import gemv_tma_triton, tma_gemv_config
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    names = ("start", "issued", "waited", "x_staged", "chunk0", "chunk_last", "end")
    for label, (N, K), behind in (("o_proj behind primary", (2048, 4096), True), ("o_proj after o_proj", (2048, 4096), False),
                                  ("qkv behind primary", (5120, 2048), True)):
        cfg = tma_gemv_config(N, K, 2, sms)
        units = 8
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(units)]
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        prim = torch.zeros(units, 2, dtype=torch.int64, device=dev)
        times = torch.zeros(units, cfg["programs"], 8, dtype=torch.int64, device=dev)

        def run():
            for u in range(units):
                if behind:
                    primary[(1,)](prim[u], 10000, EARLY=True)
                gemv_tma_triton(x, ws[u], times=times[u])
        run()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        g.replay()
        torch.cuda.synchronize()
        u = units - 1
        t0 = prim[u, 0] if behind else times[u - 1, :, 6].max()
        rel = (times[u, :, :7] - t0).double() / 1e3
        print(f"{label}: {cfg['programs']} programs, reference = "
              + ("primary start; primary end %.2f" % ((prim[u, 1] - prim[u, 0]).item() / 1e3) if behind
                 else "previous GEMV's last program end"))
        for i, n in enumerate(names):
            col = rel[:, i].sort().values
            print(f"  {n:10s} {col[0].item():7.2f} {col[len(col) // 2].item():7.2f} {col[-1].item():7.2f}")


if __name__ == "__main__":
    main()
