#!/usr/bin/env bash
# The GPU re-measurement (issue 39) in parts, each a list of `blitz bench latency` runs whose JSONs
# land in $OUT/runs/ and whose table prints at the end; $OUT/runs.tgz brings them all back in one
# file (the device tool returns at most 8). A run starts only while DEADLINE (seconds, default 560)
# leaves room for it, so one call never overruns its limit.
# Usage on the GPU machine, from the repo root: bash benchmarks/gpu_remeasure.sh PART...
#   variants  qwen3-30b-a3b batch 1 with each decode variant that was unmeasured until 2026-12-05 against
#             the default (run on a checkout of ac88e42, which has them all; docs/perf-history.md)
#   key       the acceptance rows (qwen3-30b-a3b, llama-3.1-8b batch 1); table then skips them
#   retest    the hybrid / sparse-attention GPU tests, then the e2e bf16 / fp8 parity and
#             structured-output tests
#   tests     the GPU test suite (pytest -m gpu over TEST_PATHS, default all), log in $OUT/runs/$LOG.log
#   table     the README's GPU table: qwen3-30b-a3b batch 1 and 32, llama-3.1-8b and qwen3-0.6b batch 1
#             (256 tokens), minimax-m2 / deepseek-v3 (8 layers) batch 1, 10k-token TTFT, then
#             llama-3.1-8b batch 1 with --compare hf (transformers on the same weights)
#   fp8       --weight-dtype fp8 against bf16 at batch 1 on the MoE presets and qwen3-0.6b
#   mtp       MTP on deepseek-v3 (MTP_LAYERS layers: 8, or 4 on an 80 GB card), k 1 and 3, synthetic
#             acceptance 0.9, against no speculation
#   serve     blitz serve + blitz bench serve at concurrency 256 (1,000 in / 1,000 out, llama-3.1-8b)
#   hybrid    qwen3-next-80b-a3b (8 layers) and qwen3.5-397b-a17b (Q35_LAYERS: 8, or 4 on an 80 GB card)
#             at batch 1 and 32, then benchmarks/hybrid_sparse_kernels.py gdn (post-conv, recurrent rule)
#   lora      llama-3.1-8b at batch sizes LORA_BS (default "1 8") under a rank-16 adapter against none
#             (LORA_NOLORA=0 skips that; LORA_BASE: an earlier commit's blitzllm/ beside, its LoRA the peer)
#   fp8kv     --kv-cache-dtype fp8 against auto: llama-3.1-8b at batch 32 with 2,048-token prompts and
#             deepseek-v3 (DS_LAYERS) at batch 8 with 4,096-token prompts (KV reads a large share of a step)
#   sparse    deepseek-v3.2 against deepseek-v3 (DS_LAYERS) at batch 1 with 128- and 32K-token
#             prompts, then benchmarks/hybrid_sparse_kernels.py topk
set -u
set -o pipefail  # a pytest piped into tail / tee keeps its exit status
TESTS_RC=0  # the last failing pytest run's status: the script exits with it
pytest_failed() { TESTS_RC=$1; echo "== pytest failed: rc=$1"; }
. benchmarks/gpu_env.sh
R="$OUT/runs"; mkdir -p "$R"
DEADLINE=${DEADLINE:-560}
# deepseek-v3 at 8 layers (3 dense + 5 MoE, about 120 GB of bf16 weights) fits an H200 only; an
# H100 (80 GB) takes 5 layers (3 dense + 2 MoE). DS_LAYERS overrides.
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
DS_LAYERS=${DS_LAYERS:-$([ "${mem_mib:-0}" -gt 100000 ] && echo 8 || echo 5)}
# mtp: the dummy MTP layer is one more MoE layer (about 22 GB), which at 5 layers left an 80 GB
# card a KV cache of 16 tokens (max_model_len 256 did not fit); so on such a card 4 layers (3 dense
# + 1 MoE, then the MTP layer), 8 on a larger one. MTP_LAYERS overrides.
# qwen3.5-397b-a17b: 512 experts of 4096 x 1024 are about 13 GB of bf16 a layer
Q35_LAYERS=${Q35_LAYERS:-$([ "${mem_mib:-0}" -gt 100000 ] && echo 8 || echo 4)}
MTP_LAYERS=${MTP_LAYERS:-$([ "${mem_mib:-0}" -gt 100000 ] && echo 8 || echo 4)}
M1="--batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
D1="--batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
M32="--batch-size 32 --input-len 128 --output-len 128 --max-num-seqs 32"
run() {  # run TIMEOUT NAME ARGS...: one latency bench, skipped when the deadline is too near (RUN_DIR:
  # where it runs, default here; python -m puts that folder's blitzllm/ first)
  t=$1; name=$2; shift 2; left=$((DEADLINE - SECONDS))
  if [ $left -lt 45 ]; then echo "== $name skipped (${left}s left)"; return; fi
  [ -f "$R/$name.json" ] && return  # already measured in this call (part key)
  [ $t -gt $left ] && t=$left
  s0=$SECONDS; (cd "${RUN_DIR:-.}" && timeout $t $B "$@" --json "$R/$name.json" > "$R/$name.log" 2>&1)
  echo "== $name rc=$? wall=$((SECONDS-s0))s $(env | grep -o '^BLITZ_[A-Z_]*=[^ ]*' | grep -v NO_PROGRESS | tr '\n' ' ')"; }
kernels() {  # kernels PART: benchmarks/hybrid_sparse_kernels.py PART within the deadline, its JSON kept
  left=$((DEADLINE - SECONDS - 10)); [ $left -gt 30 ] || return
  timeout $left python3 benchmarks/hybrid_sparse_kernels.py "$1" > "$R/${1}_kernels.log" 2>&1
  cp "$OUT"/hybrid_sparse_kernels.json "$R/k_$1.json.txt" 2>/dev/null; grep -v '^{' "$R/${1}_kernels.log" | tail -4; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
for part in "$@"; do case $part in
  variants)
    Q="--model preset:qwen3-30b-a3b $M1"
    run 150 q30b_def1 $Q
    BLITZ_MOE_BALANCE=1 run 100 q30b_balance $Q
    BLITZ_MOE_PF_QKV=1 run 100 q30b_pfqkv $Q
    BLITZ_ATTN_OPROJ=1 run 100 q30b_oproj $Q
    BLITZ_GEMV_TMA_NORM=1 run 100 q30b_tmanorm $Q
    BLITZ_MOE_SELECT=rank run 100 q30b_rank $Q
    run 100 q30b_def2 $Q
    DS="--model preset:deepseek-v3 --num-layers $DS_LAYERS $M1"
    run 120 dsv3_def $DS
    BLITZ_MLA_FUSED=1 run 100 dsv3_mlafused $DS
    L="--model preset:llama-3.1-8b $D1"
    run 100 llama_def $L
    BLITZ_ATTN_OPROJ=1 run 90 llama_oproj $L
    BLITZ_GEMV_TMA_NORM=1 run 90 llama_tmanorm $L ;;
  key)  # the issue's acceptance rows first: qwen3-30b-a3b and llama-3.1-8b at batch 1
    run 150 q30b_b1 --model preset:qwen3-30b-a3b $M1
    run 100 llama_b1 --model preset:llama-3.1-8b $D1 ;;
  retest)  # the tests that failed on the last GPU run: the hybrid / DSA group (TESTS_S, default 300 s; a
    # test still running after 140 s dumps every thread's stack, to tell slow from hung), then e2e
    P="python3 -m pytest -v -m gpu -p no:cacheprovider --tb=short -rf --timeout 200 --durations=15 -o faulthandler_timeout=140"
    left=$((DEADLINE - SECONDS - 150)); t=${TESTS_S:-300}; [ $t -gt $left ] && t=$left
    timeout $t $P tests/kernels/test_kernel_gdn.py tests/models/test_qwen3_next_gpu.py \
      tests/models/test_deepseek_v32_gpu.py > "$R/t_hybrid.log" 2>&1 || pytest_failed $?
    left=$((DEADLINE - SECONDS - 20))
    timeout $left $P tests/test_gpu_e2e.py -k "bf16_fast_path or fp8_weights or structured_output" > "$R/t_e2e.log" 2>&1 \
      || pytest_failed $?
    grep -hE "^FAILED|^E  .*(Error|diverged|assert|differ|tie)|passed|failed|^[0-9.]+s call" "$R"/t_*.log | cut -c1-400 | tail -50 ;;
  tests)  # TESTS_S (default 260) seconds at most, within the deadline; the summary and the failures' lines kept
    t=${TESTS_S:-260}; left=$((DEADLINE - SECONDS - 20)); [ $t -gt $left ] && t=$left
    # TEST_PATHS (default: every file with GPU tests) splits the suite over calls; LOG names its log
    log="$R/${LOG:-gpu_tests}.log"
    timeout $t python3 -m pytest -q -m gpu ${TEST_PATHS:-tests/kernels tests/models tests/test_gpu_e2e.py} -p no:cacheprovider \
      --timeout 200 -o faulthandler_timeout=150 --durations=25 -rfE > "$log" 2>&1 || pytest_failed $?
    grep -E "passed|failed|^FAILED|^ERROR|^E  |^[0-9.]+s (call|setup)" "$log" | cut -c1-400 | tail -60 ;;
  table)
    run 150 q30b_b1 --model preset:qwen3-30b-a3b $M1
    run 100 llama_b1 --model preset:llama-3.1-8b $D1
    run 80 qwen06_b1 --model preset:qwen3-0.6b $D1
    run 150 q30b_b32 --model preset:qwen3-30b-a3b $M32
    run 100 mm2_b1 --model preset:minimax-m2 --num-layers 8 $M1
    run 100 dsv3_b1 --model preset:deepseek-v3 --num-layers $DS_LAYERS $M1
    run 90 llama_ttft10k --model preset:llama-3.1-8b --batch-size 1 --input-len 10000 --output-len 4 --max-num-seqs 1 --enforce-eager
    run 240 llama_b1_hf --model preset:llama-3.1-8b $D1 --compare hf ;;
  fp8)
    run 120 q30b_fp8 --model preset:qwen3-30b-a3b $M1 --weight-dtype fp8
    run 100 mm2_fp8 --model preset:minimax-m2 --num-layers 8 $M1 --weight-dtype fp8
    run 100 dsv3_fp8 --model preset:deepseek-v3 --num-layers $DS_LAYERS $M1 --weight-dtype fp8
    run 80 qwen06_fp8 --model preset:qwen3-0.6b $D1 --weight-dtype fp8 ;;
  fp8kv)
    K="--model preset:llama-3.1-8b --batch-size 32 --input-len 2048 --output-len 128 --max-num-seqs 32"
    run 120 llama_kv_auto $K --kv-cache-dtype auto
    run 120 llama_kv_fp8 $K --kv-cache-dtype fp8
    K="--model preset:deepseek-v3 --num-layers $DS_LAYERS --batch-size 8 --input-len 4096 --output-len 128 --max-num-seqs 8"
    run 150 dsv3_kv_auto $K --kv-cache-dtype auto
    run 150 dsv3_kv_fp8 $K --kv-cache-dtype fp8 ;;
  mtp)
    D="--model preset:deepseek-v3 --num-layers $MTP_LAYERS $M1 --compare nospec"
    run 200 dsv3_mtp1 $D --speculative-config '{"method": "mtp", "num_speculative_tokens": 1, "synthetic_acceptance_rate": 0.9}'
    run 200 dsv3_mtp3 $D --speculative-config '{"method": "mtp", "num_speculative_tokens": 3, "synthetic_acceptance_rate": 0.9}' ;;
  serve)
    left=$((DEADLINE - SECONDS - 10)); [ $left -gt 60 ] && timeout $left bash benchmarks/gpu_serve.sh 2>&1 | tail -30 > "$R/serve.log"
    cp "$OUT"/serve_c*.json "$OUT"/serve.log "$R/" 2>/dev/null; grep -E "==|req/s|throughput|TPOT|tok/s" "$R/serve.log" | head -20 ;;
  hybrid)
    run 150 qnext_b1 --model preset:qwen3-next-80b-a3b --num-layers 8 $M1
    run 150 qnext_b32 --model preset:qwen3-next-80b-a3b --num-layers 8 $M32
    run 150 q35_b1 --model preset:qwen3.5-397b-a17b --num-layers $Q35_LAYERS $M1
    run 150 q35_b32 --model preset:qwen3.5-397b-a17b --num-layers $Q35_LAYERS $M32
    kernels gdn ;;
  sparse)
    L32="--batch-size 1 --input-len 32768 --output-len 64 --max-num-seqs 1"
    run 150 dsv32_b1 --model preset:deepseek-v3.2 --num-layers $DS_LAYERS $M1
    run 150 dsv3_b1 --model preset:deepseek-v3 --num-layers $DS_LAYERS $M1
    run 200 dsv32_32k --model preset:deepseek-v3.2 --num-layers $DS_LAYERS $L32
    run 200 dsv3_32k --model preset:deepseek-v3 --num-layers $DS_LAYERS $L32
    kernels topk ;;
  lora)  # llama-3.1-8b under a random rank-16 adapter on every projection against no adapter at each batch
    # size of LORA_BS (default "1 8"); with LORA_BASE (a folder holding an earlier commit's blitzllm/),
    # that code's LoRA beside; then the LoRA kernels' microseconds a step (the profiled step)
    for bs in ${LORA_BS:-1 8}; do
      L="--model preset:llama-3.1-8b --batch-size $bs --input-len 128 --output-len 128 --max-num-seqs 8"
      [ "${LORA_NOLORA:-1}" = 1 ] && run 120 llama_b${bs}_nolora $L
      run 120 llama_b${bs}_lora $L --lora-rank 16
      [ -n "${LORA_BASE:-}" ] && RUN_DIR=$LORA_BASE run 120 llama_b${bs}_lora_base $L --lora-rank 16
    done
    for f in "$R"/llama_b*_lora.json; do python3 -c "import json, sys; r = json.load(open(sys.argv[1]))
print(sys.argv[1].split('/')[-1], {k: v for k, v in r.get('kernel_time_us', {}).items() if 'shrink' in k or 'expand' in k})" "$f"; done ;;
  *) echo "unknown part $part"; exit 2 ;;
esac; done
python3 - "$R" <<'PY'
import glob, json, os, sys
keys = ["tokens_per_s", "roofline_fraction", "ms_per_token", "ttft_s", "kernels_per_layer",
        "speedup_vs_hf_eager", "speedup_vs_hf_compiled", "speedup_vs_nospec", "spec_mean_acceptance_length",
        "copy_bandwidth_Bps"]
print("run".ljust(16), *[k[:13].rjust(13) for k in keys])
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    if os.path.basename(f).startswith("serve"):
        continue
    r = json.load(open(f))
    cell = lambda v: "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
    print(os.path.basename(f)[:-5][:16].ljust(16), *[cell(r.get(k)).rjust(13) for k in keys])
PY
tar czf "$OUT/runs.tgz" -C "$OUT" runs
[ "$TESTS_RC" -eq 0 ] || echo "== a pytest run failed (rc=$TESTS_RC)"
exit "$TESTS_RC"
