"""Per-step kernel times of `blitz bench latency --json` files, divided by the layer count:
where a decode step goes, kernel by kernel. `time`: in-graph durations (with PDL on they
include each kernel's wait on the one before); `exposed`: what each kernel adds to the step
past the end of the one before it (`kernel_exposed_us`, the critical-path share). Then two
layers from the middle of the first profiled step: each kernel's start and end (us) and what
it adds. Usage: python3 tools/kernel_table.py A.json [B.json ...]"""
import json
import sys

for path in sys.argv[1:]:
    r = json.load(open(path))
    n = r.get("num_layers") or 1
    print(f"{path}: {r.get('tokens_per_s', 0):.1f} tok/s, roofline {r.get('roofline_fraction') or 0:.4f}, "
          f"span {r.get('gpu_span_us_per_step')} us, idle {r.get('gpu_idle_us_per_step')}, "
          f"overlap {r.get('kernel_overlap_us_per_step')} (us per step; kernels below: us per layer)")
    exposed = r.get("kernel_exposed_us") or {}
    print(f"  {'kernel':<60} {'time':>8} {'exposed':>8}")
    for name, us in (r.get("kernel_time_us") or {}).items():
        print(f"  {name[:60]:<60} {us / n:8.2f} {exposed.get(name, float('nan')) / n:8.2f}")
    seq = r.get("kernel_sequence") or []
    per = max(1, round(r.get("kernels_per_layer") or 1))
    mid = len(seq) // 2
    window = seq[mid - mid % per: mid - mid % per + 2 * per]
    prev = None
    for name, s, e in window:
        add = e - (s if prev is None else max(s, prev))
        print(f"    {name[:44]:<44} start {s:9.2f} end {e:9.2f} adds {add:6.2f}")
        prev = e
