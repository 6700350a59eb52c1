#!/usr/bin/env python3
"""Can the L2 hide a GEMV's weight stream behind the latency-bound kernels of a decode layer?

    python3 scripts/bench_l2.py [--spin-us 5] [--units 48]

A "unit" stands for one MoE decode layer's pieces at qwen3-30b-a3b's shapes (bf16): a 75 MB
stream (the chosen experts' weights; a plain read kernel, optionally with evict_first loads),
a latency-bound kernel that keeps one SM busy for --spin-us (the attention, the norms and
routing), and the o_proj [2048, 4096] or qkv [5120, 2048] GEMV (``gemv_triton``, its
heuristic). Eight weight sets are cycled so that nothing stays in the L2 from one unit to the
next. Variants differ only in whether, during the spin, a side-stream kernel (a parallel
branch of the CUDA graph) asks the L2 for the GEMV's weights: Hopper's bulk prefetch
(``_common.l2_prefetch``) or a read kernel that keeps the lines (evict_last). Prints us per
unit for each variant (CUDA-graph replays) and the saving against its baseline.
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
    ap.add_argument("--sets", type=int, default=8)
    ap.add_argument("--pf-programs", default="16,132")
    a = ap.parse_args()
    import torch
    import triton
    import triton.language as tl

    import decode_window

    from blitzllm.kernels._common import L2_PREFETCH_LANES, l2_prefetch, l2_prefetch_chunk
    from blitzllm.kernels.gemv import gemv_triton

    @triton.jit
    def touch_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid, nprog = tl.program_id(0), tl.num_programs(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(pid * BLOCK, n, nprog * BLOCK):
            o = off + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + o, mask=o < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
        s = tl.sum(acc, axis=0)
        tl.store(out_ptr + pid, s, mask=s == 12345.678)  # never: the loads only warm the L2

    @triton.jit
    def pf_kernel(ptr, nbytes, chunk, LANES: tl.constexpr):
        l2_prefetch(ptr, nbytes, chunk, tl.program_id(0), tl.num_programs(0), LANES)

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count
    clock_khz = getattr(props, "clock_rate", 1980000) or 1980000
    cycles = int(a.spin_us * clock_khz / 1000)
    H, NQ, NO = 2048, 5120, 4096
    big_n = 75 * 2 ** 20 // 2
    sets = []
    for _ in range(a.sets):
        sets.append(dict(big=torch.randn(big_n, device=dev, dtype=torch.bfloat16),
                         wo=torch.randn(H, NO, device=dev, dtype=torch.bfloat16) * 0.02,
                         wq=torch.randn(NQ, H, device=dev, dtype=torch.bfloat16) * 0.02))
    for i, st in enumerate(sets):
        st["wo2"] = sets[(i + 1) % len(sets)]["wo"]
    xo = torch.randn(1, NO, device=dev, dtype=torch.bfloat16)
    xq = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    sink = torch.zeros(4096, device=dev, dtype=torch.float32)
    spin_out = torch.zeros(1, device=dev, dtype=torch.int32)
    side = torch.cuda.Stream()

    def stream(s, ef):
        decode_window.stream_kernel[(2 * sms,)](s["big"], sink, big_n, BLOCK=2048, EF=ef, num_warps=8)

    def spin():
        decode_window.spin_kernel[(1,)](spin_out, cycles, num_warps=1)

    def warm(w, how):
        if how is None:
            return
        kind, progs = how
        if kind == "pf":
            nbytes = w.numel() * w.element_size()
            pf_kernel[(progs,)](w, nbytes, l2_prefetch_chunk(nbytes, progs), LANES=L2_PREFETCH_LANES, num_warps=4)
        else:
            touch_kernel[(progs,)](w, sink, w.numel(), BLOCK=4096, num_warps=8)

    def spin_with(w, how):
        if how is None:
            spin()
            return
        main_s = torch.cuda.current_stream()  # the capture stream inside torch.cuda.graph
        ev = torch.cuda.Event()
        ev.record(main_s)
        side.wait_event(ev)
        with torch.cuda.stream(side):
            warm(w, how)
        spin()
        ev2 = torch.cuda.Event()
        ev2.record(side)
        main_s.wait_event(ev2)

    def unit_o(s, how, ef=False, twice=False, no_spin=False):
        stream(s, ef)
        if not no_spin:
            spin_with(s["wo"], how)
        gemv_triton(xo, s["wo"])
        if twice:
            gemv_triton(xo, s["wo"])

    def unit_pre(s, pre, same):
        """stream; pre-read (a GEMV or a touch of wo or of another set's wo); spin; gemv(wo):
        the L2 hit when the same weights were read before the spin, without PDL overlap."""
        stream(s, False)
        w = s["wo"] if same else s["wo2"]
        if pre == "gemv":
            gemv_triton(xo, w)
        else:
            warm(w, ("touch", sms))
        spin()
        gemv_triton(xo, s["wo"])

    def unit_q(s, how, ef=False):
        spin_with(s["wq"], how)
        stream(s, ef)
        gemv_triton(xq, s["wq"])

    def time_units(fn):
        return decode_window.time_units(fn, sets, a.units)

    def trace(fn, label):
        """Kernel start / end (us from the first) of two units inside a replayed graph."""
        from torch.profiler import ProfilerActivity, profile
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(2):
                fn(sets[i])
        g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g.replay()
            torch.cuda.synchronize()
        evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
        t0 = evs[0].time_range.start if evs else 0
        print(f"trace {label}:")
        for e in evs:
            print(f"  {e.time_range.start - t0:8.2f} {e.time_range.end - t0:8.2f}  {e.name[:50]}")
        del g

    progs = [int(p) for p in a.pf_programs.split(",")]
    trace(lambda s: unit_o(s, ("touch", sms)), "o: touch during spin")
    trace(lambda s: unit_pre(s, "touch", True), "o: touch(same) spin gemv")
    rows = []
    res = {}

    def add(name, fn, base=None):
        us = time_units(fn)
        res[name] = us
        delta = f"{res[base] - us:+.2f}" if base else ""
        rows.append((name, us, delta))
        print(f"{name:36s} {us:8.2f} us/unit {delta}", flush=True)

    # spin alone and the stream alone, for the arithmetic
    add("spin only", lambda s: spin())
    add("stream only", lambda s: stream(s, False))
    add("stream only (evict_first)", lambda s: stream(s, True))
    add("o: stream+gemv (no spin)", lambda s: unit_o(s, None, no_spin=True))
    add("o: stream+spin+gemv", lambda s: unit_o(s, None))
    add("o: stream+spin+gemv+gemv(hot)", lambda s: unit_o(s, None, twice=True), "o: stream+spin+gemv")
    add("o: gemv(other) spin gemv", lambda s: unit_pre(s, "gemv", False))
    add("o: gemv(same) spin gemv", lambda s: unit_pre(s, "gemv", True), "o: gemv(other) spin gemv")
    add("o: touch(other) spin gemv", lambda s: unit_pre(s, "touch", False))
    add("o: touch(same) spin gemv", lambda s: unit_pre(s, "touch", True), "o: touch(other) spin gemv")
    for p in progs:
        add(f"o: pf{p} during spin", lambda s, p=p: unit_o(s, ("pf", p)), "o: stream+spin+gemv")
    add("o: touch132 during spin", lambda s: unit_o(s, ("touch", sms)), "o: stream+spin+gemv")
    add("q: spin+stream+gemv", lambda s: unit_q(s, None))
    add("q: spin+stream(ef)+gemv", lambda s: unit_q(s, None, ef=True))
    for p in progs:
        add(f"q: pf{p} during spin, stream", lambda s, p=p: unit_q(s, ("pf", p)), "q: spin+stream+gemv")
        add(f"q: pf{p} during spin, stream(ef)", lambda s, p=p: unit_q(s, ("pf", p), ef=True),
            "q: spin+stream(ef)+gemv")
    add("q: touch during spin, stream(ef)", lambda s: unit_q(s, ("touch", sms), ef=True), "q: spin+stream(ef)+gemv")
    bw = 4.28e12
    print(f"\nat 4.28 TB/s: stream {big_n * 2 / bw * 1e6:.2f} us, o_proj {H * NO * 2 / bw * 1e6:.2f} us, "
          f"qkv {NQ * H * 2 / bw * 1e6:.2f} us; spin {a.spin_us} us ({cycles} cycles)")
    print(f"{'variant':36s} {'us/unit':>8s} {'saved':>7s}")
    for name, us, d in rows:
        print(f"{name:36s} {us:8.2f} {d:>7s}")


if __name__ == "__main__":
    main()
