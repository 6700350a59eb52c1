#!/usr/bin/env bash
# One device call: GPU tests, then the latency benchmarks of issue 4 (table printed last).
# Usage on the GPU machine, from the repo root: bash scripts/gpu_run.sh [quick]
set -u
set -o pipefail  # a pytest piped into tail / tee keeps its exit status
TESTS_RC=0  # the last failing pytest run's status: the script exits with it
pytest_failed() { TESTS_RC=$1; echo "== pytest failed: rc=$1"; }
. scripts/gpu_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
MODE=${1:-full}
if [ "$MODE" = "final" ]; then
  run() { t=$1; name=$2; shift 2; echo "== $name: $*"; timeout $t $B "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1; echo "rc=$?"; grep -v "^\\[" "$OUT/$name.log" | tail -3; }
  run 60 llama_ttft10k --model preset:llama-3.1-8b --batch-size 1 --input-len 10000 --output-len 4 --max-num-seqs 1
  timeout 150 bash scripts/gpu_serve.sh
  exit 0
fi
if [ "$MODE" != "bench" ]; then
  timeout 170 python3 -m pytest -q -m gpu tests/kernels tests/test_gpu_e2e.py -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests.log" || pytest_failed $?
fi
run() { t=$1; name=$2; shift 2; echo "== $name: $*"; timeout $t $B "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1; echo "rc=$?"; grep -v "^\[" "$OUT/$name.log" | tail -3; }
run 70 qwen06_b1 --model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8
if [ "$MODE" = "quick" ]; then
  run 80 llama_b1 --model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8
else
  run 220 llama_b1 --model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8 --compare hf
  run 90 llama_b64 --model preset:llama-3.1-8b --batch-size 64 --input-len 1000 --output-len 64 --max-num-seqs 64
fi
run 70 llama_ttft10k --model preset:llama-3.1-8b --batch-size 1 --input-len 10000 --output-len 4 --max-num-seqs 1 --enforce-eager
if [ "$MODE" = "all" ]; then bash scripts/gpu_serve.sh; fi
python3 - "$OUT" <<'PY'
import json, sys, glob, os
keys = ["tokens_per_s", "ms_per_token", "ttft_s", "roofline_fraction", "kernels_per_layer",
        "speedup_vs_hf_eager", "speedup_vs_hf_compiled", "hf_compiled_tokens_per_s", "copy_bandwidth_Bps"]
print("run".ljust(16), *[k[:14].rjust(15) for k in keys])
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    r = json.load(open(f))
    cells = []
    for k in keys:
        v = r.get(k)
        cells.append(("-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))).rjust(15))
    print(os.path.basename(f)[:-5].ljust(16), *cells)
PY
[ "$TESTS_RC" -eq 0 ] || echo "== a pytest run failed (rc=$TESTS_RC)"
exit "$TESTS_RC"
