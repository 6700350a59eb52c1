"""Per-step kernel times of `blitz bench latency --json` files, divided by the layer count:
where a decode step goes, kernel by kernel (in-graph durations; with PDL on they include
each kernel's wait on the one before). Usage: python3 scripts/kernel_table.py A.json [B.json ...]"""
import json
import sys

for path in sys.argv[1:]:
    r = json.load(open(path))
    n = r.get("num_layers") or 1
    print(f"{path}: {r.get('tokens_per_s', 0):.1f} tok/s, roofline {r.get('roofline_fraction') or 0:.4f}, "
          f"span {r.get('gpu_span_us_per_step')} us, idle {r.get('gpu_idle_us_per_step')}, "
          f"overlap {r.get('kernel_overlap_us_per_step')} (us per step; kernels below: us per layer)")
    for name, us in (r.get("kernel_time_us") or {}).items():
        print(f"  {name[:60]:<60} {us / n:8.2f}")
