"""The issue-8 table: reads `blitz bench latency --json` results named by benchmarks/gpu_tp.sh
(llama_tp{N}_b{B}[_nccl].json, q30b_tp{N}_b{B}.json) from one or more folders and prints
tok/s, TPOT and the ratios: TP=N against TP=1 (batch 1) and the fused all-reduce + RMSNorm
against NCCL + a separate norm (same TP size and batch).
Usage: python3 benchmarks/tp_table.py DIR [DIR...]"""
import glob
import json
import os
import re
import sys

NAME = re.compile(r"^(llama|q30b)_tp(\d+)_b(\d+)(_nccl)?\.json$")


def load(dirs):
    runs = {}
    for d in dirs:
        for f in sorted(glob.glob(os.path.join(d, "*.json"))):
            m = NAME.match(os.path.basename(f))
            if m:
                r = json.load(open(f))
                runs[(m[1], int(m[2]), int(m[3]), bool(m[4]))] = r
    return runs


def main(dirs) -> int:
    runs = load(dirs)
    if not runs:
        print(f"no llama_tp*/q30b_tp* results in {' '.join(dirs)}")
        return 1
    base = runs.get(("llama", 1, 1, False))
    print(f"{'model':6} {'TP':>3} {'batch':>5} {'all-reduce':>11} {'tok/s':>9} {'TPOT ms':>8} "
          f"{'x TP=1':>7} {'fused/nccl TPOT':>16}")
    for (model, tp, b, nccl), r in sorted(runs.items()):
        tps, tpot = r["tokens_per_s"], r["ms_per_token"]
        vs_tp1 = f"{tps / base['tokens_per_s']:.3f}" if base and model == "llama" and b == 1 else "-"
        pair = runs.get((model, tp, b, not nccl))
        ratio = "-"
        if pair is not None and not nccl:  # > 1: the fused path's TPOT is that much shorter
            ratio = f"{pair['ms_per_token'] / tpot:.3f}"
        mode = "nccl+norm" if nccl else ("fused" if tp > 1 else "-")
        print(f"{model:6} {tp:>3} {b:>5} {mode:>11} {tps:>9.1f} {tpot:>8.3f} {vs_tp1:>7} {ratio:>16}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or [os.environ.get("OUT", "/tmp/blitz_out")]))
