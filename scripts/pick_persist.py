"""Prints the fastest correct persistent-MoE variant of $OUT/moe_decode.json (scripts/
bench_moe_decode.py) as BLITZ_MOE_PERSISTENT_CONFIG JSON, or nothing."""
import json
import os
import sys

rs = [r for r in json.load(open(os.path.join(os.environ.get("OUT", "."), "moe_decode.json")))
      if r.get("launch") == "persist" and "us" in r and r.get("err", 1) < 2e-2]
if rs:
    best = min(rs, key=lambda r: r["us"])
    print(json.dumps(best["config"] or {}))
    print(f"best persistent variant {best['variant']}: {best['us']:.2f} us", file=sys.stderr)
