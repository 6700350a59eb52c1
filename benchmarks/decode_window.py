"""Pieces shared by the decode-layer microbenchmarks (benchmarks/gemv_tma.py):
a one-program kernel that keeps busy for a number of clock cycles (a latency-bound kernel such as
the decode attention; ``EARLY`` lets its PDL dependents launch as it starts), a plain read of a
large buffer (the experts' weight stream; ``EF``: evict_first loads), and the timer of a CUDA graph
of repeated units."""
import torch
import triton
import triton.language as tl


@triton.jit
def spin_kernel(out_ptr, cycles, EARLY: tl.constexpr = False):
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0)
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [n], dtype=tl.int64, is_pure=False, pack=1)
    t = t0
    while t - t0 < cycles:
        n += 1
        t = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [n], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(out_ptr, n)


@triton.jit
def stream_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, EF: tl.constexpr = False):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(pid * BLOCK, n, nprog * BLOCK):
        o = off + tl.arange(0, BLOCK)
        if EF:
            v = tl.load(x_ptr + o, mask=o < n, other=0.0, eviction_policy="evict_first")
        else:
            v = tl.load(x_ptr + o, mask=o < n, other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def time_units(fn, sets: list, units: int) -> float:
    """us per unit: ``fn(sets[i % len(sets)])`` for i < units captured in one CUDA graph (after
    a warm-up call off the capture), the median of 7 timings of 3 replays."""
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        fn(sets[0])
    main.wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(units):
            fn(sets[i % len(sets)])
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(3):
            g.replay()
        en.record()
        en.synchronize()
        times.append(st.elapsed_time(en) * 1e3 / (3 * units))
    del g
    return sorted(times)[3]
