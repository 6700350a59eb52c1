#!/usr/bin/env bash
# Serving benchmark on the GPU (issue 3): blitz serve with preset:llama-3.1-8b dummy weights,
# random 1000-in / 1000-out prompts at concurrency 1 and 256. Run from the repo root.
set -u
OUT=${OUT:-/tmp/blitz_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 BLITZ_NO_PROGRESS=1 TOKENIZERS_PARALLELISM=false
PORT=8123
python3 -m blitzllm.cli serve --model preset:llama-3.1-8b --port $PORT --max-model-len 2048 \
  --max-num-seqs 256 --log-level warning > "$OUT/serve.log" 2>&1 &
SP=$!
for i in $(seq 1 120); do
  curl -sf http://127.0.0.1:$PORT/health >/dev/null 2>&1 && break
  python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" >/dev/null 2>&1 && break
  sleep 1
done
echo "server ready after ${i}s"; grep -i "captured" "$OUT/serve.log" | tail -1
bs() { c=$1; n=$2; echo "== concurrency $c, $n prompts"
  timeout 200 python3 -m blitzllm.cli bench serve --base-url http://127.0.0.1:$PORT --dataset random \
    --input-len 1000 --output-len 1000 --num-prompts $n --concurrency $c --no-progress \
    --save-json "$OUT/serve_c$c.json" 2>&1 | tail -22 | tee "$OUT/serve_c$c.log"; }
bs 1 2
bs 256 256
kill $SP; wait $SP 2>/dev/null
