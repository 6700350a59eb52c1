#!/usr/bin/env bash
# Issue 6 CPU A/B of train-draft options on a small set: prompts 81-100 (greedy + 2 answers
# at T=1.0, 128 tokens), eval on 141-160 greedy k=3 through --eval-range. One run per
# variant "name=extra args" (sequential; each takes both cores), results in $DIR/name.json.
#   DIR=/work/ab6 bash benchmarks/ab_draft.sh "base=" "wide4=--draft-intermediate 6144" "ep10=--epochs 10"
set -u
DIR=${DIR:-/tmp/ab_draft}; mkdir -p "$DIR"
for v in "$@"; do
  name=${v%%=*}; extra=${v#*=}
  /usr/bin/time -f "%e s" blitz train-draft --model smollm2 --prompts ${PROMPTS:-../shared/data/mt_bench_questions.jsonl} \
    --prompt-range 81-100 --samples-per-prompt 3 --temperature 1.0 --max-tokens 128 --epochs 3 \
    --draft-vocab 4096 --out "$DIR/h_$name" --eval-range 141-160 --eval-k 3 --eval-max-tokens 128 $extra \
    > "$DIR/$name.json" 2> "$DIR/$name.log"
  echo "$name: $(cat "$DIR/$name.json")"
done
