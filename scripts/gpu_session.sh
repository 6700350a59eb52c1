#!/usr/bin/env bash
# One device call for the decode fast path: GPU tests, the GEMV sweep, and latency A/B
# (Triton GEMV vs cuBLAS via BLITZ_GEMV). Usage: bash scripts/gpu_session.sh [tests|gemv|lat|serve]...
set -u
set -o pipefail  # a pytest piped into tail / tee keeps its exit status
TESTS_RC=0  # the last failing pytest run's status: the script exits with it
pytest_failed() { TESTS_RC=$1; echo "== pytest failed: rc=$1"; }
. scripts/gpu_env.sh
# QUIET=1: one line per run (the table at the end has the figures), so a long call's output fits
run() { t=$1; name=$2; shift 2; [ -n "${QUIET:-}" ] || echo "== $name: $*"; s0=$SECONDS
  timeout $t $B "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1; rc=$?
  if [ -n "${QUIET:-}" ]; then echo "== $name rc=$rc wall=$((SECONDS-s0))s"; return; fi
  echo "rc=$rc wall=$((SECONDS-s0))s"
  grep -v "^\[" "$OUT/$name.log" | grep -E "tokens_per_s |ms_per|roofline|kernels_per_layer|ttft|speedup|busy|gpu_" ; }
for part in "$@"; do case $part in
  tests) timeout 330 python3 -m pytest -q -m gpu tests/kernels tests/test_gpu_e2e.py -p no:cacheprovider -x 2>&1 | tail -15 | tee "$OUT/gpu_tests.log" || pytest_failed $? ;;
  gemv) timeout 200 python3 benchmarks/gemv_sweep.py --budget-s 150 2>&1 | tail -40 ;;
  lat1) run 80 qwen06_b1 --model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8
       run 90 llama_b1 --model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8 ;;
  lat) run 80 qwen06_b1 --model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8
       BLITZ_GEMV=0 run 80 qwen06_b1_cublas --model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8
       run 90 llama_b1 --model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8
       BLITZ_GEMV=0 run 90 llama_b1_cublas --model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8 ;;
  pdl) Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 80 qwen_pdl1_norm1 $Q; BLITZ_PDL=0 run 80 qwen_pdl0_norm1 $Q; BLITZ_GEMV_NORM=0 run 80 qwen_pdl1_norm0 $Q
       run 90 llama_pdl1_norm1 $L; BLITZ_GEMV_NORM=0 run 90 llama_pdl1_norm0 $L; BLITZ_PDL=0 run 90 llama_pdl0_norm1 $L ;;
  ab2) Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 80 qwen_norm1 $Q; BLITZ_GEMV_NORM=0 run 80 qwen_norm0 $Q
       run 90 llama_norm1 $L; BLITZ_GEMV_NORM=0 run 90 llama_norm0 $L ;;
  moek) timeout 200 python3 benchmarks/moe_kernels.py --budget-s 100 2>&1 | tail -30
        timeout 120 python3 benchmarks/mla_decode.py 2>&1 | tail -16 ;;
  moelat) run 150 q30b_b1 --model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8
       run 150 q30b_b32 --model preset:qwen3-30b-a3b --batch-size 32 --input-len 128 --output-len 128 --max-num-seqs 32
       run 150 dsv3_l8_b1 --model preset:deepseek-v3 --num-layers 8 --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8
       run 150 mm2_l8_b1 --model preset:minimax-m2 --num-layers 8 --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8 ;;
  moeab) M="--batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_b1 --model preset:qwen3-30b-a3b $M; BLITZ_MOE_DIRECT=1 run 150 q30b_b1_direct --model preset:qwen3-30b-a3b $M
       BLITZ_MOE_DIRECT=1 BLITZ_MOE_FUSED_ROUTING=1 run 150 q30b_b1_direct_route --model preset:qwen3-30b-a3b $M
       BLITZ_MOE_GEMV=1 BLITZ_MOE_FUSED_ROUTING=1 run 150 q30b_b1_gemv_route --model preset:qwen3-30b-a3b $M ;;
  moel2) M="--batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_b1 --model preset:qwen3-30b-a3b $M; BLITZ_L2_PREFETCH=1 run 150 q30b_b1_l2pf --model preset:qwen3-30b-a3b $M ;;
  mlaab) M="--batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 dsv3_l8_b1 --model preset:deepseek-v3 --num-layers 8 $M
       BLITZ_MLA_FUSED=1 BLITZ_MOE_DIRECT=1 run 150 dsv3_l8_b1_fused --model preset:deepseek-v3 --num-layers 8 $M ;;
  quick) timeout 240 python3 -m pytest -q tests/test_gpu_e2e.py tests/kernels/test_kernel_greedy.py \
           -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/gpu_quick.log" || pytest_failed $? ;;
  qwen) run 80 qwen_b1 --model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8 ;;
  stash) cp .xa/part /tmp/xa_part && ls -la /tmp/xa_part ;;
  ab3) Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 80 qwen_new $Q; BLITZ_GREEDY_KERNEL=0 run 80 qwen_nogreedy $Q; BLITZ_GEMV_DEPTH=2 run 80 qwen_depth2 $Q
       run 100 llama_new $L; BLITZ_GEMV_DEPTH=2 run 100 llama_depth2 $L ;;
  ab4) L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 100 llama_base $L; BLITZ_GEMV_SILU_MAX_WEIGHTS=$((32<<20)) run 100 llama_silu_cublas $L
       BLITZ_GEMV_SILU_MAX_WEIGHTS=$((32<<20)) BLITZ_GEMV_MAX_WEIGHTS=$((8<<20)) run 100 llama_all_cublas $L ;;
  fin) M="--batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 100 llama_b1 --model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8
       run 150 q30b_b1 --model preset:qwen3-30b-a3b $M; BLITZ_MOE_GEMV=1 run 150 q30b_b1_gemv --model preset:qwen3-30b-a3b $M ;;
  gemvab) L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 100 llama_gemv_default $L
       BLITZ_GEMV_CONFIG='{"BLOCK_N": 8, "num_warps": 4}' run 100 llama_gemv_n8w4 $L
       BLITZ_GEMV_CONFIG='{"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4}' run 100 llama_gemv_n4k1024 $L
       BLITZ_GEMV_CONFIG='{"BLOCK_N": 32, "num_warps": 8}' run 100 llama_gemv_n32w8 $L ;;
  chain) Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       timeout 300 python3 -m pytest -q tests/kernels/test_kernel_gemv.py tests/test_gpu_e2e.py tests/kernels/test_kernel_greedy.py \
         -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/gpu_chain_tests.log" || pytest_failed $?
       BLITZ_NORM_CHAIN=1 run 80 qwen_chain $Q; BLITZ_NORM_CHAIN=0 run 80 qwen_nochain $Q ;;
  ab5) Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 80 qwen_base $Q; BLITZ_NORM_CHAIN=1 run 80 qwen_chain $Q; BLITZ_ATTN_MAX_SPLITS=1 run 80 qwen_split1 $Q
       BLITZ_ATTN_MAX_SPLITS=4 run 80 qwen_split4 $Q; BLITZ_GEMV_CONFIG='{"BLOCK_K": 1024}' run 80 qwen_k1024 $Q
       run 100 llama_base $L; BLITZ_ATTN_MAX_SPLITS=1 run 100 llama_split1 $L; BLITZ_ATTN_MAX_SPLITS=4 run 100 llama_split4 $L ;;
  ab6) Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 80 qwen_base $Q; BLITZ_PDL_EARLY=1 run 80 qwen_early $Q
       BLITZ_PDL_EARLY=1 BLITZ_GEMV_CONFIG='{"BLOCK_K": 1024}' run 80 qwen_early_k1024 $Q || true
       grep -v "^\[" "$OUT/qwen_early_k1024.log" | grep -iE "error|exception" | tail -3
       run 100 llama_base $L; BLITZ_PDL_EARLY=1 run 100 llama_early $L ;;
  ab7) L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 100 llama_base $L; BLITZ_GEMV_MAX_WEIGHTS=$((64<<20)) run 100 llama_down_gemv $L ;;
  tma) # issue 5: o_proj / qkv as the TMA GEMV (weights streamed before the PDL wait, behind the attention / RMSNorm)
       timeout 200 python3 -m pytest -q -x --tb=short -m gpu tests/kernels/test_kernel_gemv_tma.py -p no:cacheprovider 2>&1 | tail -3 || pytest_failed $?
       timeout 200 python3 benchmarks/gemv_tma.py 2>&1 | tail -12
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 150 q30b_tma $M; BLITZ_GEMV_TMA=0 run 150 q30b_tma0 $M; BLITZ_GEMV_TMA=nodeps run 150 q30b_nodeps $M
       run 80 qwen06_tma $Q; BLITZ_GEMV_TMA=0 run 80 qwen06_tma0 $Q
       run 100 llama_tma $L; BLITZ_GEMV_TMA=0 run 100 llama_tma0 $L
       python3 tools/kernel_table.py "$OUT/q30b_tma.json" "$OUT/q30b_tma0.json" 2>&1 | tail -30 ;;
  tmaq) # the tma part's qwen3-30b-a3b runs only (kernel test, microbenchmark, batch 1 with and without)
       timeout 200 python3 -m pytest -q -x --tb=short -m gpu tests/kernels/test_kernel_gemv_tma.py -p no:cacheprovider 2>&1 | tail -3 || pytest_failed $?
       timeout 200 python3 benchmarks/gemv_tma.py 2>&1 | tail -12
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_tma $M; BLITZ_GEMV_TMA=0 run 150 q30b_tma0 $M
       python3 tools/kernel_table.py "$OUT/q30b_tma.json" "$OUT/q30b_tma0.json" 2>&1 | tail -30 ;;
  tmaab) # the TMA GEMV's GPU tests, then batch 1 with and without it on the dense presets and qwen3-30b-a3b
       timeout 300 python3 -m pytest -q --tb=short -m gpu tests/kernels/test_kernel_gemv_tma.py tests/test_gpu_e2e.py \
         -p no:cacheprovider -k "tma or bf16" 2>&1 | tail -3 || pytest_failed $?
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 80 qwen06_tma $Q; BLITZ_GEMV_TMA=0 run 80 qwen06_tma0 $Q; BLITZ_GEMV_TMA=o_proj run 80 qwen06_tmao $Q
       run 100 llama_tma $L; BLITZ_GEMV_TMA=0 run 100 llama_tma0 $L
       run 150 q30b_tma $M; BLITZ_GEMV_TMA=0 run 150 q30b_tma0 $M ;;
  tmafin) # issue 5 acceptance 2 with the TMA GEMV: qwen3-30b-a3b batch 1 (default, lm_head too, off, PDL off) and batch 32
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_b1 $M; BLITZ_GEMV_TMA=lm_head run 150 q30b_b1_lmh $M; BLITZ_GEMV_TMA=0 run 150 q30b_b1_tma0 $M
       BLITZ_PDL=0 run 150 q30b_b1_nopdl $M
       run 200 q30b_b32 --model preset:qwen3-30b-a3b --batch-size 32 --input-len 128 --output-len 128 --max-num-seqs 32
       python3 tools/kernel_table.py "$OUT/q30b_b1.json" "$OUT/q30b_b1_nopdl.json" 2>&1 | tail -24 ;;
  moetma) # issue 5: the one-launch TMA MoE (kernels/moe_tma.py, BLITZ_MOE_TMA=1): its GPU tests (stop if they
       # fail), the kernel alone against the direct path's two launches (with in-graph timelines), then
       # qwen3-30b-a3b batch 1 with it (its engine timeline; dependents launched early too) and without
       timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -x --tb=short -m gpu tests/kernels/test_kernel_moe_tma.py \
         -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/moe_tma_tests.log" || pytest_failed $?
       grep -q " passed" "$OUT/moe_tma_tests.log" && ! grep -q "failed\|error" "$OUT/moe_tma_tests.log" || exit 3
       timeout 240 python3 scripts/bench_moe_tma.py ${MOETMA_ARGS:-} 2>&1 | tail -60 > "$OUT/bench_moe_tma.log"
       grep -A9 "qwen3-30b-a3b timeline" "$OUT/bench_moe_tma.log" | head -10; tail -3 "$OUT/bench_moe_tma.log"
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       BLITZ_MOE_TMA=1 BLITZ_MOE_TMA_TIMES=$OUT/tl_e2e.txt run 150 q30b_moetma_tl $M; cat $OUT/tl_e2e.txt
       BLITZ_MOE_TMA=1 run 150 q30b_moetma $M; BLITZ_MOE_TMA=1 BLITZ_MOE_TMA_DEPS=early run 150 q30b_moetma_early $M
       run 150 q30b_moetma0 $M; python3 tools/kernel_table.py $OUT/q30b_moetma.json | head -8 ;;
  moetmae2e) timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q --tb=line -m gpu tests/test_gpu_e2e.py -k "tma_moe" \
         -p no:cacheprovider 2>&1 | tail -12 | tee "$OUT/moe_tma_e2e.log" || pytest_failed $? ;;
  attn27) # qwen3-30b-a3b batch 1: the decode attention's tiles re-checked end to end (64 keys per tile:
       # 4 splits at 256 keys, the first tile preloaded; 4 warps for its 8 query heads per KV head)
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 a_default $M; BLITZ_ATTN_BLOCK_N=64 run 100 a_bn64 $M; BLITZ_ATTN_WARPS=4 run 100 a_w4 $M
       rm -f "$OUT"/a_*.log
       python3 tools/kernel_table.py "$OUT"/a_*.json | grep -v "^    " ;;
  atom28) # stop 28: the MoE down programs' atomic fp32 combine (default) against the counted combine
       # (BLITZ_MOE_ATOMIC_COMBINE=0), twice each on qwen3-30b-a3b batch 1 (a third arm, a one-round
       # ranked expert selection, measured 411.1 / 410.8 against 417.8 / 417.8 and was removed); then the
       # GPU tests of the changed kernels and paths
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       for i in 1 2; do run 150 at_default$i $M; BLITZ_MOE_ATOMIC_COMBINE=0 run 100 at_counted$i $M; done
       rm -f "$OUT"/at_*.log
       python3 tools/kernel_table.py "$OUT"/at_*.json | grep -v "^    " | grep -v "_greedy\|indexSelect\|^  kernel"
       timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q --tb=short tests/kernels/test_kernel_moe.py \
         tests/kernels/test_kernel_rmsnorm_act.py -k "select or direct or fp32 or norm_route or fused_add or gpu" \
         -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/atom28_tests.log" || pytest_failed $?
       timeout ${E2E_TIMEOUT:-200} python3 -m pytest -q --tb=short -m gpu tests/test_gpu_e2e.py \
         -k "atomic or norm_route" -p no:cacheprovider 2>&1 | tail -4 | tee -a "$OUT/atom28_tests.log" || pytest_failed $? ;;
  s31) # the first call when a GPU is lent again (stop 31): all four of stop 30's opt-in paths in one call, so one
       # call answers which of them to pursue: their tests (no timing if one fails), then qwen3-30b-a3b batch 1:
       # the default, BALANCE (the expected largest: 36 SMs idle in the gate/up launch now), PF, OPROJ, BALANCE + PF,
       # all four, the default and BALANCE again; the per-layer kernel tables of default / BALANCE / all four
       timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q --tb=short tests/kernels/test_kernel_oproj_partials.py \
         tests/kernels/test_kernel_paged_attention.py tests/kernels/test_kernel_moe.py tests/kernels/test_kernel_gemv_tma.py \
         tests/test_gpu_e2e.py -k "oproj or partials or norm_route or pf_qkv or balanced or norm_form or with_the_norm" \
         -p no:cacheprovider 2>&1 | tail -8 | tee "$OUT/s31_tests.log" || pytest_failed $?
       if grep -q "failed\|error" "$OUT/s31_tests.log"; then echo "s31: a test failed, no timing"; else
         M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
         run 150 q30b_def1 $M
         BLITZ_MOE_BALANCE=1 run 100 q30b_bal1 $M
         BLITZ_MOE_PF_QKV=1 run 100 q30b_pf1 $M
         BLITZ_ATTN_OPROJ=1 run 100 q30b_op1 $M
         BLITZ_MOE_BALANCE=1 BLITZ_MOE_PF_QKV=1 run 100 q30b_balpf1 $M
         BLITZ_MOE_BALANCE=1 BLITZ_MOE_PF_QKV=1 BLITZ_ATTN_OPROJ=1 BLITZ_GEMV_TMA_NORM=1 run 100 q30b_all1 $M
         run 100 q30b_def2 $M
         BLITZ_MOE_BALANCE=1 run 100 q30b_bal2 $M
         rm -f "$OUT"/*.log
         python3 tools/kernel_table.py "$OUT"/q30b_def1.json "$OUT"/q30b_bal1.json "$OUT"/q30b_all1.json \
           | grep -v "^    " | grep -v "_greedy\|indexSelect"
       fi ;;
  fp831) # weight_dtype='fp8' (stop 31: block-FP8 linears and experts, W8A16, kernels/fp8_weights.py): its kernel and e2e
       # tests, then batch 1 bf16 against fp8 on qwen3-30b-a3b, deepseek-v3 (8 layers), minimax-m2 (8 layers), qwen3-0.6b
       timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q --tb=short tests/kernels/test_kernel_fp8_weights.py tests/test_gpu_e2e.py \
         -k "fp8" -p no:cacheprovider 2>&1 | tail -6 | tee "$OUT/fp831_tests.log" || pytest_failed $?
       M="--batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_bf16 --model preset:qwen3-30b-a3b $M
       run 150 q30b_fp8 --model preset:qwen3-30b-a3b $M --weight-dtype fp8
       run 100 dsv3_bf16 --model preset:deepseek-v3 --num-layers 8 $M
       run 100 dsv3_fp8 --model preset:deepseek-v3 --num-layers 8 $M --weight-dtype fp8
       run 100 mm2_bf16 --model preset:minimax-m2 --num-layers 8 $M
       run 100 mm2_fp8 --model preset:minimax-m2 --num-layers 8 $M --weight-dtype fp8
       run 60 q06_fp8 --model preset:qwen3-0.6b $M --weight-dtype fp8
       rm -f "$OUT"/*.log
       python3 tools/kernel_table.py "$OUT"/q30b_bf16.json "$OUT"/q30b_fp8.json | grep -v "^    " | grep -v "_greedy\|indexSelect" ;;
  so31) # structured outputs on CUDA (stop 31; add xgrammar and apache_tvm_ffi to the cp312 wheels carried in
       # .whl, which gpu_env.sh installs): the GPU test
       timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q --tb=short tests/test_gpu_e2e.py -k "structured" \
         -p no:cacheprovider 2>&1 | tail -4 || pytest_failed $? ;;
  mtp31) # MTP speculation (stop 31, spec/mtp.py; its target runs eager): the GPU test, then preset:deepseek-v3 with
       # 8 layers at batch 1, k 1 and 3 at a synthetic acceptance of 0.9, each against no speculation in the same run
       timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q --tb=short tests/test_gpu_e2e.py -k "mtp" -p no:cacheprovider \
         2>&1 | tail -4 | tee "$OUT/mtp31_tests.log" || pytest_failed $?
       D="--model preset:deepseek-v3 --num-layers 8 --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8 --compare nospec"
       run 200 dsv3_mtp1 $D --speculative-config '{"method": "mtp", "num_speculative_tokens": 1, "synthetic_acceptance_rate": 0.9}'
       run 200 dsv3_mtp3 $D --speculative-config '{"method": "mtp", "num_speculative_tokens": 3, "synthetic_acceptance_rate": 0.9}'
       rm -f "$OUT"/*.log ;;
  s30) # stop 30, issue 5 acceptance 2: o_proj merging the decode attention's split partials itself
       # (BLITZ_ATTN_OPROJ=1, kernels/oproj_partials.py) and the next layer's weights prefetched into the
       # L2 by the MoE norm + router launch (BLITZ_MOE_PF_QKV=1: qkv, =qkvo: qkv and o_proj, evict-last):
       # their tests (no timing if one fails), then qwen3-30b-a3b batch 1 (the default and the best
       # combination twice) and the per-layer kernel tables
       timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q --tb=short tests/kernels/test_kernel_oproj_partials.py \
         tests/kernels/test_kernel_paged_attention.py tests/kernels/test_kernel_moe.py tests/test_gpu_e2e.py \
         -k "oproj or partials or norm_route or pf_qkv" -p no:cacheprovider 2>&1 | tail -8 | tee "$OUT/s30_tests.log" || pytest_failed $?
       if grep -q "failed\|error" "$OUT/s30_tests.log"; then echo "s30: a test failed, no timing"; else
         M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
         run 150 q30b_def1 $M
         BLITZ_ATTN_OPROJ=1 run 100 q30b_op1 $M
         BLITZ_MOE_PF_QKV=1 run 100 q30b_pf1 $M
         BLITZ_MOE_PF_QKV=qkvo run 100 q30b_pfo1 $M
         BLITZ_ATTN_OPROJ=1 BLITZ_MOE_PF_QKV=1 run 100 q30b_both1 $M
         BLITZ_ATTN_OPROJ=1 BLITZ_MOE_PF_QKV=qkvo run 100 q30b_botho1 $M
         run 100 q30b_def2 $M
         BLITZ_ATTN_OPROJ=1 BLITZ_MOE_PF_QKV=1 run 100 q30b_both2 $M
         rm -f "$OUT"/*.log
         python3 tools/kernel_table.py "$OUT"/q30b_def1.json "$OUT"/q30b_op1.json "$OUT"/q30b_pf1.json \
           | grep -v "^    " | grep -v "_greedy\|indexSelect"
       fi ;;
  s30b) # the second call for stop 30's paths: the prefetch unmarked (=normal) and in one range per program, the head-split o_proj with
       # 16-key attention tiles, the input RMSNorm inside the qkv TMA GEMV (BLITZ_GEMV_TMA_NORM=1) alone and
       # with the other two, and batch 32 with the switches OP / PF (BLITZ_ATTN_OPROJ / BLITZ_MOE_PF_QKV) as set
       timeout ${TEST_TIMEOUT:-180} python3 -m pytest -q --tb=short tests/kernels/test_kernel_gemv_tma.py tests/test_gpu_e2e.py \
         -k "norm_form or with_the_norm" -p no:cacheprovider 2>&1 | tail -6 | tee "$OUT/s30b_tests.log" || pytest_failed $?
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_def3 $M
       BLITZ_MOE_PF_QKV=normal run 100 q30b_pfn $M
       BLITZ_MOE_PF_QKV=1 BLITZ_MOE_PF_QKV_LANES=1 run 100 q30b_pfl1 $M  # (one 164 KB prefetch per program, not 8)
       BLITZ_ATTN_OPROJ=1 BLITZ_ATTN_BLOCK_N=16 run 100 q30b_op16 $M  # (no merge: smaller key tiles, more splits)
       BLITZ_GEMV_TMA_NORM=1 run 100 q30b_tn $M
       BLITZ_GEMV_TMA_NORM=1 BLITZ_ATTN_OPROJ=1 BLITZ_MOE_PF_QKV=1 run 100 q30b_all $M
       W="--model preset:qwen3-30b-a3b --batch-size 32 --input-len 128 --output-len 128 --max-num-seqs 32"
       run 150 q30b_b32 $W
       BLITZ_ATTN_OPROJ=${OP:-1} BLITZ_MOE_PF_QKV=${PF:-1} run 150 q30b_b32_arms $W  # (both only reach 1-2 / 1-4 rows)
       rm -f "$OUT"/*.log ;;
  bal30) # BLITZ_MOE_BALANCE=1: the direct MoE gate/up programs take balanced_rows output rows each (qwen3-30b-a3b
       # at one token: 128 programs of 48 rows instead of 96 of 64): its tests, then batch 1 against the
       # default (twice each, alternating) and with every stop-30 switch on
       timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q --tb=short tests/kernels/test_kernel_moe.py tests/test_gpu_e2e.py \
         -k "balanced or fused_moe_direct" -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/bal30_tests.log" || pytest_failed $?
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_def4 $M
       BLITZ_MOE_BALANCE=1 run 100 q30b_bal1 $M
       run 100 q30b_def5 $M
       BLITZ_MOE_BALANCE=1 run 100 q30b_bal2 $M
       BLITZ_MOE_BALANCE=1 BLITZ_ATTN_OPROJ=1 BLITZ_MOE_PF_QKV=1 BLITZ_GEMV_TMA_NORM=1 run 100 q30b_all4 $M
       X="--model preset:minimax-m2 --num-layers 8 --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 100 mm2_def $X
       BLITZ_MOE_BALANCE=1 run 100 mm2_bal $X  # (96-row programs in 128-wide tiles)
       rm -f "$OUT"/*.log
       python3 tools/kernel_table.py "$OUT"/q30b_def4.json "$OUT"/q30b_bal1.json | grep -v "^    " | grep -v "_greedy\|indexSelect" ;;
  pfw30) # with qkv's weights in the L2 (BLITZ_MOE_PF_QKV) its post-wait compute is what remains (3.3 us per
       # layer at stop 25's count): 16-row tiles on 16 warps, and the products on the tensor cores (ab29's form)
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_def6 $M
       BLITZ_MOE_PF_QKV=qkvo run 100 q30b_pfo2 $M
       BLITZ_MOE_PF_QKV=qkvo BLITZ_GEMV_TMA_BLOCK_N=16 BLITZ_GEMV_TMA_WARPS=16 run 100 q30b_pfw16 $M
       BLITZ_MOE_PF_QKV=qkvo BLITZ_GEMV_TMA_MMA=1 run 100 q30b_pfmma $M
       rm -f "$OUT"/*.log ;;
  pf30t) # evidence for BLITZ_MOE_PF_QKV: the TMA GEMVs' per-program timelines (when each program's first
       # copy lands, after its wait) with and without the prefetch: do qkv's weights come from the L2?
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       BLITZ_GEMV_TMA_TIMES="$OUT/times_def.txt" run 100 q30b_tdef $M
       BLITZ_MOE_PF_QKV=1 BLITZ_GEMV_TMA_TIMES="$OUT/times_pf.txt" run 100 q30b_tpf $M
       cat "$OUT"/times_*.txt
       rm -f "$OUT"/*.log ;;
  op30d) # BLITZ_ATTN_OPROJ=1 on the dense presets at batch 1 (qwen3-0.6b, llama-3.1-8b), default first
       Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 80 qwen_def $Q; BLITZ_ATTN_OPROJ=1 run 80 qwen_op $Q
       run 90 llama_def $L; BLITZ_ATTN_OPROJ=1 run 90 llama_op $L ;;
  ab29) # qwen3-30b-a3b batch 1: the tensor-core TMA GEMV with its wgmmas queued per tile, the selection by
       # rank, against the defaults; the tensor-core form's precision; the GPU tests of both
       timeout 120 python3 scripts/mma_precision.py 2>&1 | tail -6 | tee "$OUT/ab29_precision.log"
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_def $M
       BLITZ_GEMV_TMA_MMA=1 run 100 q30b_mma $M
       BLITZ_MOE_SELECT=rank run 100 q30b_rank $M
       run 100 q30b_def2 $M
       BLITZ_MOE_SELECT=rank run 100 q30b_rank2 $M
       BLITZ_GEMV_TMA_MMA=1 BLITZ_MOE_SELECT=rank run 100 q30b_both $M
       BLITZ_GEMV_TMA_TIMES="$OUT/times_fma.txt" run 100 q30b_tfma $M
       BLITZ_GEMV_TMA_MMA=1 BLITZ_GEMV_TMA_TIMES="$OUT/times_mma.txt" run 100 q30b_tmma $M
       cat "$OUT"/times_*.txt
       rm -f "$OUT"/*.log
       python3 tools/kernel_table.py "$OUT"/q30b_mma.json "$OUT"/q30b_rank.json | grep -v "^    " | grep -v "_greedy\|indexSelect"
       timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q --tb=line -m gpu tests/kernels/test_kernel_moe.py \
         tests/kernels/test_kernel_gemv_tma.py tests/test_gpu_e2e.py -k "select_experts or tensor_cores or matches_reference_gpu" \
         -p no:cacheprovider 2>&1 | tail -6 | tee "$OUT/ab29_tests.log" || pytest_failed $? ;;
  mma29) # the TMA GEMV's products on the tensor cores (BLITZ_GEMV_TMA_MMA=1): its GPU tests, then
       # qwen3-30b-a3b batch 1 against the FMA form (twice each, alternating) and qwen3-0.6b
       timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q --tb=short -m gpu tests/kernels/test_kernel_gemv_tma.py \
         tests/test_gpu_e2e.py -k "gemv_tma or tma_gemv or matches_reference or graph" -p no:cacheprovider 2>&1 \
         | tail -8 | tee "$OUT/mma29_tests.log" || pytest_failed $?
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_fma $M
       BLITZ_GEMV_TMA_MMA=1 run 100 q30b_mma $M
       run 100 q30b_fma2 $M
       BLITZ_GEMV_TMA_MMA=1 run 100 q30b_mma2 $M
       Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 80 q06_fma $Q
       BLITZ_GEMV_TMA_MMA=1 run 80 q06_mma $Q
       rm -f "$OUT"/*.log.x
       python3 tools/kernel_table.py "$OUT"/q30b_fma.json "$OUT"/q30b_mma.json | grep -v "_greedy\|indexSelect"
       for f in "$OUT"/q*.json; do python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], r['tokens_per_s'], r['roofline_fraction'])" "$f"; done ;;
  fin28) # stop 28 close: issue 5 acceptance 2 (batch 1 and 32), the x widening of the TMA GEMV and the down
       # launch's early dependents against the defaults, minimax-m2 (8 layers) batch 1, the whole GPU suite
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_b1 $M
       BLITZ_GEMV_TMA_HOIST=0 run 100 q30b_b1_nohoist $M
       BLITZ_MOE_DOWN_EARLY_DEPS=1 run 100 q30b_b1_earlydeps $M
       run 100 q30b_b1_again $M
       run 200 q30b_b32 --model preset:qwen3-30b-a3b --batch-size 32 --input-len 128 --output-len 128 --max-num-seqs 32
       run 150 mm2_l8_b1 --model preset:minimax-m2 --num-layers 8 --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8
       rm -f "$OUT"/*.log
       python3 tools/kernel_table.py "$OUT"/q30b_b1*.json | grep -v "^    " | grep -v "_greedy\|indexSelect\|^  kernel"
       timeout ${TEST_TIMEOUT:-380} python3 -m pytest -q --tb=short -m gpu tests/kernels tests/test_gpu_e2e.py \
         -p no:cacheprovider 2>&1 | tail -12 | tee "$OUT/fin28_tests.log" || pytest_failed $? ;;
  fin27) # stop 27 close: issue 5 acceptance 2 (batch 1 and 32), the MoE e2e checks, then the whole GPU suite
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_b1 $M
       run 200 q30b_b32 --model preset:qwen3-30b-a3b --batch-size 32 --input-len 128 --output-len 128 --max-num-seqs 32
       rm -f "$OUT"/q30b_*.log
       python3 tools/kernel_table.py "$OUT/q30b_b1.json" | grep -v "^    "
       timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q --tb=short -m gpu tests/kernels tests/test_gpu_e2e.py \
         -p no:cacheprovider 2>&1 | tail -12 | tee "$OUT/fin27_tests.log" || pytest_failed $? ;;
  fin26) # stop 26 close: the GPU tests of this stop's kernels (decode attention's combine, the routing
       # helpers, the direct MoE with the selection inside), the MoE e2e tests, issue 5 acceptance 2
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_b1 $M
       run 200 q30b_b32 --model preset:qwen3-30b-a3b --batch-size 32 --input-len 128 --output-len 128 --max-num-seqs 32
       python3 tools/kernel_table.py "$OUT/q30b_b1.json" | grep -v "^    "
       timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q --tb=short tests/kernels/test_kernel_paged_attention.py \
         tests/kernels/test_kernel_moe.py -k "combine or decode or gpu or norm_route or select or direct" \
         -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/fin26_tests.log" || pytest_failed $?
       timeout ${E2E_TIMEOUT:-150} python3 -m pytest -q --tb=short -m gpu tests/test_gpu_e2e.py \
         -k "norm_route_decode_matches_default or (tma_moe and ROUTE)" -p no:cacheprovider 2>&1 | tail -3 \
         | tee -a "$OUT/fin26_tests.log" || pytest_failed $? ;;
  nrsel) # qwen3-30b-a3b batch 1: the expert selection in the norm + router launch's last program
       # (BLITZ_MOE_NORM_ROUTE=1) with fewer programs (router rows per program), against the default
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 nr_default $M
       BLITZ_MOE_NORM_ROUTE=1 run 100 nr1 $M
       BLITZ_MOE_NORM_ROUTE=1 BLITZ_MOE_NORM_ROUTE_BLOCK_E=4 run 100 nr1_be4 $M
       BLITZ_MOE_NORM_ROUTE=1 BLITZ_MOE_NORM_ROUTE_BLOCK_E=16 BLITZ_MOE_NORM_ROUTE_WARPS=8 run 100 nr1_be16 $M
       BLITZ_MOE_NORM_ROUTE_BLOCK_E=4 run 100 nr2_be4 $M
       python3 tools/kernel_table.py "$OUT"/nr*.json | grep -v "^    " ;;
  overlap) # qwen3-30b-a3b batch 1: the down launch letting the next RMSNorm (and so the qkv GEMV) launch
       # early, alone and with 3-stage down tiles (60 KB: a qkv program fits beside one), and the decode
       # attention's combine in one round (8192 values)
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 ov_default $M
       BLITZ_MOE_DOWN_EARLY_DEPS=1 run 100 ov_early $M
       BLITZ_MOE_DOWN_EARLY_DEPS=1 BLITZ_MOE_DECODE_CONFIG='{"down": {"num_stages": 3}}' run 100 ov_early_st3 $M
       BLITZ_MOE_DOWN_EARLY_DEPS=1 BLITZ_MOE_DECODE_CONFIG='{"down": {"BLOCK_N": 32}}' run 100 ov_early_bn32 $M
       BLITZ_ATTN_COMBINE_ELEMS=8192 run 100 ov_comb $M
       BLITZ_ATTN_COMBINE_ELEMS=8192 BLITZ_MOE_DOWN_EARLY_DEPS=1 BLITZ_MOE_DECODE_CONFIG='{"down": {"num_stages": 3}}' \
         run 100 ov_all $M
       python3 tools/kernel_table.py "$OUT"/ov_*.json | grep -v "^    " ;;
  cfgsweep) # qwen3-30b-a3b batch 1 end to end with the direct MoE's tiles overridden (BLITZ_MOE_DECODE_CONFIG):
       # down and gate/up variants against the heuristic; then batch 32 (default)
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 sw_default $M
       i=0
       for c in '{"down": {"BLOCK_N": 32}}' '{"down": {"BLOCK_N": 128, "num_warps": 8}}' \
                '{"down": {"num_stages": 3}}' '{"down": {"BLOCK_K": 64, "num_stages": 6}}' \
                '{"down": {"num_warps": 8}}' '{"down": {"BLOCK_N": 32, "BLOCK_K": 256, "num_stages": 3}}' \
                '{"up": {"BLOCK_N": 32}}' '{"up": {"BLOCK_K": 256, "num_stages": 3}}' '{"up": {"num_warps": 8}}' \
                '{"up": {"num_stages": 3}}'; do
         i=$((i+1)); echo "sw$i $c" | tee -a "$OUT/sweep_keys.txt"
         BLITZ_MOE_DECODE_CONFIG="$c" run 100 sw$i $M
       done
       for f in "$OUT"/sw*.json; do python3 -c "
import json,sys; r=json.load(open('$f')); n=r['num_layers']; e=r.get('kernel_exposed_us',{})
print('%-14s %7.1f tok/s  roofline %.4f  moe exposed %6.2f us/layer' % ('$f'.split('/')[-1][:-5], r['tokens_per_s'], r['roofline_fraction'], e.get('_moe_gemm_kernel',0)/n))"; done
       run 200 q30b_b32 --model preset:qwen3-30b-a3b --batch-size 32 --input-len 128 --output-len 128 --max-num-seqs 32 ;;
  tdown) # the direct MoE path's down GEMM as the TMA down launch (BLITZ_MOE_TMA_DOWN=1): its GPU tests,
       # then qwen3-30b-a3b batch 1 with and without (kernel_table: each kernel's critical-path share),
       # then its e2e tests
       timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q --tb=short -m gpu tests/kernels/test_kernel_moe_tma.py \
         -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/tdown_tests.log" || pytest_failed $?
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_b1 $M; BLITZ_MOE_TMA_DOWN=1 run 150 q30b_b1_tdown $M
       python3 tools/kernel_table.py "$OUT/q30b_b1.json" "$OUT/q30b_b1_tdown.json"
       timeout ${E2E_TIMEOUT:-200} python3 -m pytest -q --tb=short -m gpu tests/test_gpu_e2e.py \
         -k "tma_moe and MOE_TMA_DOWN" -p no:cacheprovider 2>&1 | tail -4 | tee -a "$OUT/tdown_tests.log" || pytest_failed $? ;;
  expo) # qwen3-30b-a3b batch 1: each kernel's critical-path share (kernel_exposed_us) and two layers'
       # timeline, default and with the selection in the norm + router launch (BLITZ_MOE_NORM_ROUTE=1)
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_b1 $M; BLITZ_MOE_NORM_ROUTE=1 run 150 q30b_b1_nr1 $M
       python3 tools/kernel_table.py "$OUT/q30b_b1.json" "$OUT/q30b_b1_nr1.json" ;;
  fin25) # stop 25 close: the TMA MoE's GPU tests and both TMA e2e tests, then issue 5 acceptance 2 on the
       # default path (qwen3-30b-a3b batch 1 and 32) and batch 1 with BLITZ_MOE_TMA=1
       timeout 100 python3 -m pytest -q --tb=short -m gpu tests/kernels/test_kernel_moe_tma.py -p no:cacheprovider \
         2>&1 | tail -3 | tee "$OUT/fin25_tests.log" || pytest_failed $?
       timeout 200 python3 -m pytest -q --tb=short -m gpu tests/test_gpu_e2e.py -k "tma" -p no:cacheprovider \
         2>&1 | tail -3 | tee -a "$OUT/fin25_tests.log" || pytest_failed $?
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_b1 $M; BLITZ_MOE_TMA=1 run 150 q30b_b1_moetma $M
       run 200 q30b_b32 --model preset:qwen3-30b-a3b --batch-size 32 --input-len 128 --output-len 128 --max-num-seqs 32 ;;
  moediag) # qwen3-30b-a3b batch 1 with PDL and without (each kernel's own time): tools/kernel_table.py on the JSONs
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_b1 $M; BLITZ_PDL=0 run 150 q30b_b1_nopdl $M
       python3 tools/kernel_table.py "$OUT/q30b_b1.json" "$OUT/q30b_b1_nopdl.json" ;;
  attrib) # per-kernel times without PDL overlap (each kernel starts after the one before ends)
       Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       BLITZ_PDL=0 run 80 qwen_nopdl $Q; BLITZ_PDL=0 run 100 llama_nopdl $L ;;
  l2ab) # L2 prefetch of the next GEMVs' weights from the fused decode attention kernel
       timeout 120 python3 -m pytest -q -x --tb=short tests/kernels/test_kernel_paged_attention.py -k "l2_prefetch or fused" \
         -p no:cacheprovider 2>&1 | tail -4 || pytest_failed $?
       Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 80 qwen_base $Q; BLITZ_L2_PREFETCH=1 run 80 qwen_l2pf $Q
       run 100 llama_base $L; BLITZ_L2_PREFETCH=1 run 100 llama_l2pf $L
       BLITZ_L2_PREFETCH=1 BLITZ_L2_PREFETCH_MB=56 run 100 llama_l2pf56 $L ;;
  attntests) timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -x --tb=short tests/kernels/test_kernel_paged_attention.py \
         tests/test_gpu_e2e.py tests/kernels/test_kernel_qk_norm_rope_cache.py -p no:cacheprovider 2>&1 | tail -3 || pytest_failed $? ;;
  fmlp) # the one-launch decode MLP (kernels/fused_mlp.py) against gate_up + down
       timeout 120 python3 -m pytest -q -x tests/kernels/test_kernel_fused_mlp.py -p no:cacheprovider 2>&1 | tail -1 || pytest_failed $?
       Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 80 qwen_base $Q; BLITZ_FUSED_MLP=1 run 80 qwen_fmlp $Q
       run 100 llama_base $L; BLITZ_FUSED_MLP=1 run 100 llama_fmlp $L ;;
  depth) # GEMV FMA path: W tiles two ahead (three register buffers) vs one
       Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 80 qwen_base $Q; BLITZ_GEMV_DEPTH=2 run 80 qwen_depth2 $Q
       run 100 llama_base $L; BLITZ_GEMV_DEPTH=2 run 100 llama_depth2 $L ;;
  optab) # every opt-in decode path (L2 prefetch, one-launch MLP, GEMV depth 2) alone and together, after their e2e test
       timeout 150 python3 -m pytest -q -x --tb=short tests/test_gpu_e2e.py -k opt_in -p no:cacheprovider 2>&1 | tail -2 || pytest_failed $?
       Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 80 qwen_base $Q; BLITZ_L2_PREFETCH=1 run 80 qwen_l2pf $Q; BLITZ_FUSED_MLP=1 run 80 qwen_fmlp $Q
       BLITZ_GEMV_DEPTH=2 run 80 qwen_depth2 $Q; BLITZ_L2_PREFETCH=1 BLITZ_FUSED_MLP=1 BLITZ_GEMV_DEPTH=2 run 80 qwen_all3 $Q
       run 100 llama_base $L; BLITZ_L2_PREFETCH=1 run 100 llama_l2pf $L; BLITZ_FUSED_MLP=1 run 100 llama_fmlp $L
       BLITZ_GEMV_DEPTH=2 run 100 llama_depth2 $L ;;
  tile) # decode attention tile / warps end to end (qwen), and where each step's GPU time goes (idle = waiting on the host)
       Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 80 qwen_base $Q; BLITZ_ATTN_BLOCK_N=32 run 80 qwen_bn32 $Q; BLITZ_ATTN_BLOCK_N=16 run 80 qwen_bn16 $Q
       BLITZ_ATTN_WARPS=2 run 80 qwen_w2 $Q; BLITZ_ATTN_WARPS=8 run 80 qwen_w8 $Q
       BLITZ_ATTN_BLOCK_N=32 BLITZ_ATTN_WARPS=2 run 80 qwen_bn32w2 $Q; run 80 qwen_base2 $Q
       run 100 llama_base $L; BLITZ_MOE_DIRECT=1 run 150 q30b_direct --model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8 ;;
  tile2) # decode attention tile / warps: qwen, llama batch 1 and 64, qwen3-30b-a3b (MoE direct by default now)
       Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       L64="--model preset:llama-3.1-8b --batch-size 64 --input-len 1000 --output-len 64 --max-num-seqs 64"
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       export BLITZ_ATTN_BLOCK_N=32; run 80 qwen_bn32 $Q; run 80 qwen_bn32b $Q; BLITZ_ATTN_WARPS=8 run 80 qwen_bn32w8 $Q
       BLITZ_ATTN_BLOCK_N=16 BLITZ_ATTN_WARPS=8 run 80 qwen_bn16w8 $Q; BLITZ_ATTN_BLOCK_N=16 BLITZ_ATTN_WARPS=2 run 80 qwen_bn16w2 $Q
       BLITZ_ATTN_BLOCK_N=0 run 100 llama_base $L; run 100 llama_bn32 $L; BLITZ_ATTN_WARPS=8 run 100 llama_bn32w8 $L
       BLITZ_ATTN_BLOCK_N=0 run 100 llama_b64 $L64; run 100 llama_b64_bn32 $L64
       BLITZ_ATTN_BLOCK_N=0 run 150 q30b $M; run 150 q30b_bn32 $M; unset BLITZ_ATTN_BLOCK_N ;;
  bnlong) # decode attention tile at long contexts (32 keys, the default, vs 64): llama batch 1 with 1,000
       # prompt + 1,000 output tokens, and a 8,000-token prompt
       L1="--model preset:llama-3.1-8b --batch-size 1 --input-len 1000 --output-len 1000 --max-num-seqs 8"
       L8="--model preset:llama-3.1-8b --batch-size 1 --input-len 8000 --output-len 256 --max-num-seqs 8"
       run 100 llama_1k $L1; BLITZ_ATTN_BLOCK_N=64 run 100 llama_1k_bn64 $L1
       run 100 llama_8k $L8; BLITZ_ATTN_BLOCK_N=64 run 100 llama_8k_bn64 $L8 ;;
  moepf) # direct MoE: the gate/up launch prefetches the chosen experts' down weights into the L2
       timeout 150 python3 -m pytest -q -x --tb=short tests/kernels/test_kernel_moe.py -k "prefetch" -p no:cacheprovider 2>&1 | tail -1 || pytest_failed $?
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_base $M; BLITZ_MOE_PF_DOWN=1 run 150 q30b_pfdown $M
       run 150 q30b_base2 $M; BLITZ_MOE_PF_DOWN=1 run 150 q30b_pfdown2 $M ;;
  moeattrib) # qwen3-30b-a3b batch 1 per-kernel times without PDL overlap (each kernel's own time)
       BLITZ_PDL=0 run 150 q30b_nopdl --model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8 ;;
  silu) # Llama-3.1-8B down_proj as the GEMV with the SiLU-and-mul fused into its input (wider N tiles
       # now) instead of a SiLU-and-mul kernel then the GEMV
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 100 llama_base $L; BLITZ_GEMV_SILU_MAX_WEIGHTS=-1 run 100 llama_silu $L
       run 100 llama_base2 $L; BLITZ_GEMV_SILU_MAX_WEIGHTS=-1 run 100 llama_silu2 $L ;;
  diagpf) timeout 60 python3 scripts/diag_prefetch.py 2>&1 | tail -6 ;;
  l2) timeout 120 python3 benchmarks/decode_attention.py --only-l2 2>&1 | tail -8 ;;
  attn) timeout 300 python3 benchmarks/decode_attention.py 2>&1 | tail -30 | tee "$OUT/bench_attn.log" ;;
  eqk) # q/k-side loads of the fused decode kernel before (default) / after its PDL wait
       Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 80 qwen_eqk $Q; BLITZ_ATTN_EARLY_QK=0 run 80 qwen_late $Q; BLITZ_GEMV_NORM=1 run 80 qwen_gnorm $Q
       run 100 llama_eqk $L; BLITZ_ATTN_EARLY_QK=0 run 100 llama_late $L ;;
  gemvtests) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x --tb=short tests/kernels/test_kernel_greedy.py tests/kernels/test_kernel_gemv.py \
       -p no:cacheprovider 2>&1 | grep -v "^\s*$" | tail -25 | tee "$OUT/gemv_tests.log" || pytest_failed $? ;;
  latcmp) run 240 llama_b1 --model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8 --compare hf ;;
  b64) run 100 llama_b64 --model preset:llama-3.1-8b --batch-size 64 --input-len 1000 --output-len 64 --max-num-seqs 64 ;;
  ttft) run 70 llama_ttft10k --model preset:llama-3.1-8b --batch-size 1 --input-len 10000 --output-len 4 --max-num-seqs 1 --enforce-eager ;;
  gen1k) run 80 llama_1k1k --model preset:llama-3.1-8b --batch-size 1 --input-len 1000 --output-len 1000 --max-num-seqs 8 ;;
  serve) timeout 200 bash scripts/gpu_serve.sh ;;
  swap) # the swapped tensor-core GEMV form (W the wide MMA operand, pipelined) against cuBLAS and the
       # heuristic on Llama-3.1-8B's decode shapes at one row
       timeout 240 python3 benchmarks/gemv_sweep.py --swap-only --models llama-3.1-8b --layers qkv,o_proj,down,gate_up \
         --ms 1 --budget-s 200 > "$OUT/gemv_swap.log" 2>&1; tail -8 "$OUT/gemv_swap.log" ;;
  glutests) timeout 200 python3 -m pytest -q -x --tb=short -m gpu tests/kernels/test_kernel_gemv.py tests/test_gpu_e2e.py \
         -k "glu or gpu_linear" -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/glu_tests.log" || pytest_failed $? ;;
  glu) # gate_up on the GEMV (Llama-3.1-8B's is past the plain GEMV's 64M-weight limit: cuBLAS by default),
       # and as the GLU GEMV (SiLU-and-mul in its epilogue, no SiLU-and-mul launch)
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 100 llama_base $L; BLITZ_GEMV_MAX_WEIGHTS=$((128<<20)) run 100 llama_gu_gemv $L
       BLITZ_GEMV_GLU=1 run 100 llama_glu $L; run 80 qwen_base $Q; BLITZ_GEMV_GLU=1 run 80 qwen_glu $Q ;;
  chainab) # the GLU GEMV (default) alone and in the norm chain (no RMSNorm launches); deepseek-v3's
       # shared experts with and without the GLU GEMV
       L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       Q="--model preset:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       D="--model preset:deepseek-v3 --num-layers 8 --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 100 llama_glu $L; BLITZ_NORM_CHAIN=1 run 100 llama_glu_chain $L
       run 80 qwen_glu $Q; BLITZ_NORM_CHAIN=1 run 80 qwen_glu_chain $Q
       run 150 dsv3_glu $D; BLITZ_GEMV_GLU=0 run 150 dsv3_noglu $D ;;
  sharedab) # deepseek-v3 (8 layers) with the shared experts on a second CUDA stream (default) and on the
       # main stream; qwen3-30b-a3b per-kernel times without PDL overlap, printed here
       D="--model preset:deepseek-v3 --num-layers 8 --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 dsv3_stream $D; BLITZ_SHARED_EXPERT_STREAM=0 run 150 dsv3_nostream $D
       BLITZ_PDL=0 run 150 q30b_nopdl --model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8
       python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print([(k[:32], v) for k, v in r['kernel_time_us'].items()][:9])" "$OUT/q30b_nopdl.json" ;;
  gemvq30b) # the GEMV heuristic and sweep on qwen3-30b-a3b's qkv / o_proj at 1 row (2.66 TB/s end to end)
       timeout 200 python3 benchmarks/gemv_sweep.py --models qwen3-30b-a3b --layers qkv,o_proj --ms 1 --budget-s 150 \
         > "$OUT/gemv_q30b.log" 2>&1; tail -6 "$OUT/gemv_q30b.log" ;;
  moewide) # direct MoE decode tiles: the heuristic (64-wide N tiles since stop 19; before, N narrowed to
       # >= 2 programs per SM) vs n64 k128 set explicitly
       M="--batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"; W='{"BLOCK_N": 64, "BLOCK_K": 128}'
       run 150 q30b_base --model preset:qwen3-30b-a3b $M; BLITZ_MOE_DECODE_CONFIG=$W run 150 q30b_wide --model preset:qwen3-30b-a3b $M
       run 150 dsv3_base --model preset:deepseek-v3 --num-layers 8 $M
       BLITZ_MOE_DECODE_CONFIG=$W run 150 dsv3_wide --model preset:deepseek-v3 --num-layers 8 $M
       run 150 mm2_base --model preset:minimax-m2 --num-layers 8 $M
       BLITZ_MOE_DECODE_CONFIG=$W run 150 mm2_wide --model preset:minimax-m2 --num-layers 8 $M ;;
  moedec) # batch-1 MoE decode launches apart: the direct gate/up and down GEMMs over a tile grid
       timeout ${MOEDEC_TIMEOUT:-300} python3 benchmarks/moe_decode_tiles.py --models ${MOEDEC_MODELS:-qwen3-30b-a3b} \
         --budget-s ${MOEDEC_BUDGET:-220} > "$OUT/moe_decode.log" 2>&1; tail -${MOEDEC_TAIL:-4} "$OUT/moe_decode.log" ;;
  moeearly) # qwen3-30b-a3b batch 1: heuristic, wide tiles (n64 k128)
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_base $M; BLITZ_MOE_DECODE_CONFIG='{"BLOCK_N": 64, "BLOCK_K": 128}' run 150 q30b_wide $M ;;
  attnq30b) # decode attention at qwen3-30b-a3b's heads (32 q / 4 kv, q/k norm): split counts, tiles, warps
       timeout 200 python3 benchmarks/decode_attention.py --models qwen3-30b-a3b --contexts 192,2048 --layers 48 --no-l2 \
         --splits-sweep > "$OUT/attn_q30b.log" 2>&1; tail -21 "$OUT/attn_q30b.log" ;;
  moebest) # qwen3-30b-a3b batch 1: the best gate/up and down tiles of benchmarks/moe_decode_tiles.py, and n64 k128
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       BLITZ_MOE_DECODE_CONFIG='{"up": {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 2, "num_stages": 4}, "down": {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}}' run 150 q30b_best $M
       BLITZ_MOE_DECODE_CONFIG='{"BLOCK_N": 64, "BLOCK_K": 128}' run 150 q30b_wide2 $M ;;
  nrtests) timeout 240 python3 -m pytest -q -x --tb=short -m gpu tests/kernels/test_kernel_moe.py tests/test_gpu_e2e.py \
         -k "norm_route or direct" -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/nr_tests.log" || pytest_failed $? ;;
  normroute) # MoE decode: post-attention norm + router + selection in one launch (BLITZ_MOE_NORM_ROUTE=1), on
       # the wide MoE tiles; 8-warp decode attention; the fused routing again; deepseek-v3 / minimax-m2 wide tiles
       M="--batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"; W='{"BLOCK_N": 64, "BLOCK_K": 128}'
       export BLITZ_MOE_DECODE_CONFIG=$W
       BLITZ_MOE_NORM_ROUTE=1 run 150 q30b_wide_nr --model preset:qwen3-30b-a3b $M
       BLITZ_MOE_NORM_ROUTE=1 BLITZ_ATTN_WARPS=8 run 150 q30b_wide_nr_w8 --model preset:qwen3-30b-a3b $M
       BLITZ_MOE_FUSED_ROUTING=1 run 150 q30b_wide_fr --model preset:qwen3-30b-a3b $M
       run 150 q30b_wide3 --model preset:qwen3-30b-a3b $M
       for m in deepseek-v3 minimax-m2; do n=${m%%-*}
         BLITZ_MOE_DECODE_CONFIG= run 150 ${n}_base --model preset:$m --num-layers 8 $M
         run 150 ${n}_wide --model preset:$m --num-layers 8 $M
         BLITZ_MOE_NORM_ROUTE=1 run 150 ${n}_wide_nr --model preset:$m --num-layers 8 $M; done
       unset BLITZ_MOE_DECODE_CONFIG ;;
  nrwarps) # the one-launch norm + routing at 1 and 2 warps per program (wide MoE tiles, 8-warp attention)
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       export BLITZ_MOE_DECODE_CONFIG='{"BLOCK_N": 64, "BLOCK_K": 128}'
       run 150 q30b_wide_aw8 $M; BLITZ_MOE_NORM_ROUTE=1 BLITZ_MOE_NORM_ROUTE_WARPS=1 run 150 q30b_nr_w1 $M
       BLITZ_MOE_NORM_ROUTE=1 BLITZ_MOE_NORM_ROUTE_WARPS=2 run 150 q30b_nr_w2 $M; unset BLITZ_MOE_DECODE_CONFIG ;;
  nr2) # MoE decode routing: default (three launches) vs the one-launch norm + routing with its dependents
       # launched late (after the routing), vs the norm + router GEMM in one launch and the selection apart
       # (BLITZ_MOE_NORM_ROUTE=2), with early and late dependents; then their GPU tests
       M="--model preset:qwen3-30b-a3b --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_base $M; BLITZ_MOE_NORM_ROUTE=1 BLITZ_MOE_NORM_ROUTE_PDL=late run 150 q30b_nr1_late $M
       BLITZ_MOE_NORM_ROUTE=2 run 150 q30b_nr2 $M; BLITZ_MOE_NORM_ROUTE=2 BLITZ_MOE_NORM_ROUTE_PDL=late run 150 q30b_nr2_late $M
       timeout 200 python3 -m pytest -q -x --tb=short -m gpu tests/kernels/test_kernel_moe.py tests/test_gpu_e2e.py \
         -p no:cacheprovider -k "norm_route" 2>&1 | tail -3 || pytest_failed $? ;;
  nrfin) # the norm + router launch as the default: the MoE presets at batch 1 (qwen3-30b-a3b batch 32 too), the
       # three-launch routing (BLITZ_MOE_NORM_ROUTE=0) beside on deepseek-v3 / minimax-m2, then the routing GPU tests
       M="--batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 8"
       run 150 q30b_b1 --model preset:qwen3-30b-a3b $M
       run 150 q30b_b32 --model preset:qwen3-30b-a3b --batch-size 32 --input-len 128 --output-len 128 --max-num-seqs 32
       run 150 dsv3_l8_b1 --model preset:deepseek-v3 --num-layers 8 $M; run 150 mm2_l8_b1 --model preset:minimax-m2 --num-layers 8 $M
       BLITZ_MOE_NORM_ROUTE=0 run 150 dsv3_l8_nr0 --model preset:deepseek-v3 --num-layers 8 $M
       BLITZ_MOE_NORM_ROUTE=0 run 150 mm2_l8_nr0 --model preset:minimax-m2 --num-layers 8 $M
       timeout 120 python3 -m pytest -q -x --tb=short -m gpu tests/kernels/test_kernel_moe.py tests/test_gpu_e2e.py \
         -p no:cacheprovider -k "norm_route or moe" 2>&1 | tail -3 || pytest_failed $? ;;
  swapab) L="--model preset:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --max-num-seqs 8"
       run 100 llama_base $L; BLITZ_GEMV_CONFIG='{"SWAP": true}' run 100 llama_swap64 $L
       BLITZ_GEMV_CONFIG='{"SWAP": true, "BLOCK_N": 128}' run 100 llama_swap128 $L ;;
esac; done
python3 - "$OUT" <<'PY'
import json, sys, glob, os
rows = []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json")), key=os.path.getmtime):
    r = json.load(open(f))
    if "kernel_time_us" in r and not os.environ.get("QUIET"):
        print(os.path.basename(f), "busy_us", r.get("kernel_busy_us"), "span", r.get("gpu_span_us_per_step"),
              "idle", r.get("gpu_idle_us_per_step"), "top:",
              [(k[:40], v) for k, v in list(r["kernel_time_us"].items())[:6]])
    if "tokens_per_s" in r:
        extra = "".join(f"  {k} {r[k]:.4g}" for k in ("ttft_s", "speedup_vs_hf_compiled", "gpu_idle_us_per_step")
                        if isinstance(r.get(k), (int, float)))
        rows.append(f"{os.path.basename(f)[:-5]:<24} {r['tokens_per_s']:9.1f} tok/s  roofline {r.get('roofline_fraction') or 0:.4f}"
                    f"  k/l {r.get('kernels_per_layer') or 0:.3f}{extra}")
print("\n".join(rows))
PY
[ "$TESTS_RC" -eq 0 ] || echo "== a pytest run failed (rc=$TESTS_RC)"
exit "$TESTS_RC"
