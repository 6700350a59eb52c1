#!/usr/bin/env bash
# Issue 8, tensor parallelism on a multi-GPU host (nvidia-h200-x2 / -x4): the runs, then the
# table (benchmarks/tp_table.py) of every result under $OUT. Parts (several device calls fit the
# 10-minute limit; pass the fetched folders to tp_table.py for one table):
#   tests   GPU tests of the tensor-parallel code
#   base    llama-3.1-8b batch 1 at TP = 1 and each of $TP_SIZES
#   fused   llama-3.1-8b at batch 1, 8, 64 for each TP > 1: fused all-reduce + RMSNorm
#           (one-shot symmetric memory) vs BLITZ_TP_ONESHOT=0 (NCCL, then the norm kernel)
#   moe     qwen3-30b-a3b at TP=2, batch 1 and 32
# Env: TP_SIZES (default "2"), MODEL / MOE_MODEL / DEVICE / EXTRA to point it elsewhere (a CPU
# smoke run: DEVICE=cpu MODEL=<tiny checkpoint> EXTRA="--max-model-len 64" ...).
set -u
set -o pipefail  # a pytest piped into tail / tee keeps its exit status
TESTS_RC=0  # the last failing pytest run's status: the script exits with it
pytest_failed() { TESTS_RC=$1; echo "== pytest failed: rc=$1"; }
. benchmarks/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # spawned workers inherit
TP_SIZES=${TP_SIZES:-2}
MODEL=${MODEL:-preset:llama-3.1-8b}
MOE_MODEL=${MOE_MODEL:-preset:qwen3-30b-a3b}
DEV=${DEVICE:+--device $DEVICE}
I=${INPUT_LEN:-128}; O=${OUTPUT_LEN:-256}
run() { t=$1; name=$2; shift 2; echo "== $name: $*"
        timeout $t $B "$@" ${DEV:-} ${EXTRA:-} --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1; echo "rc=$?"
        grep -v "^\[" "$OUT/$name.log" | grep -E "^tokens_per_s |ms_per_token|roofline|Error" ; }
for part in "$@"; do case $part in
  tests) timeout 400 python3 -m pytest -q -m gpu tests/distributed tests/kernels/test_kernel_allreduce_rmsnorm.py \
           -p no:cacheprovider 2>&1 | tail -6 | tee "$OUT/gpu_tp_tests.log" || pytest_failed $? ;;
  base) for n in 1 $TP_SIZES; do
          run 200 llama_tp${n}_b1 --model $MODEL --batch-size 1 --input-len $I --output-len $O --max-num-seqs 8 \
            --tensor-parallel-size $n
        done ;;
  fused) for n in $TP_SIZES; do for b in 1 8 64; do
           [ -f "$OUT/llama_tp${n}_b${b}.json" ] || run 200 llama_tp${n}_b${b} --model $MODEL --batch-size $b \
             --input-len $I --output-len $O --max-num-seqs $((b > 8 ? b : 8)) --tensor-parallel-size $n
           BLITZ_TP_ONESHOT=0 run 200 llama_tp${n}_b${b}_nccl --model $MODEL --batch-size $b --input-len $I \
             --output-len $O --max-num-seqs $((b > 8 ? b : 8)) --tensor-parallel-size $n
         done; done ;;
  moe) for b in 1 32; do
         run 300 q30b_tp2_b${b} --model $MOE_MODEL --batch-size $b --input-len $I --output-len 128 \
           --max-num-seqs $((b > 8 ? b : 8)) --tensor-parallel-size 2
       done ;;
  *) echo "unknown part $part (tests base fused moe)"; exit 2 ;;
esac; done
python3 benchmarks/tp_table.py "$OUT"
[ "$TESTS_RC" -eq 0 ] || echo "== a pytest run failed (rc=$TESTS_RC)"
exit "$TESTS_RC"
