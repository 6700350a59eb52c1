"""Greedy speculative acceptance of any speculative_config on MT-bench first turns, at one or
more answer lengths (a fresh engine per length), e.g. the n-gram baseline an EAGLE-3 head
should beat on the same prompts:

  python3 benchmarks/draft_acceptance.py --model smollm2 --range 141-160 --max-tokens 128,1024 \
      --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'

Prints one JSON line per length (the engine's spec_* counters and the answer lengths)."""
import argparse
import json
import time

from blitzllm.llm import LLM
from blitzllm.sampling_params import SamplingParams
from blitzllm.spec.train_draft import load_prompts, parse_range, prompt_ids

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="smollm2")
ap.add_argument("--prompts", default="blitzllm/bench/data/mt_bench_questions.jsonl")
ap.add_argument("--range", default="141-160")
ap.add_argument("--max-tokens", default="128")
ap.add_argument("--speculative-config", required=True)
ap.add_argument("--device", default=None)
ap.add_argument("--dtype", default="float32")
a = ap.parse_args()
prompts = load_prompts(a.prompts, parse_range(a.range))
for n in (int(x) for x in a.max_tokens.split(",")):
    llm = LLM(a.model, device=a.device, dtype=a.dtype, speculative_config=json.loads(a.speculative_config))
    t0 = time.perf_counter()
    outs = llm.generate([prompt_ids(llm, t) for _, t in prompts], SamplingParams(temperature=0.0, max_tokens=n))
    st = llm.stats()
    res = {k: st[k] for k in ("spec_draft_tokens", "spec_accepted_tokens", "spec_acceptance_per_position",
                              "spec_mean_acceptance_length")}
    res.update(max_tokens=n, answer_lengths=sorted(len(o.outputs[0].token_ids) for o in outs),
               seconds=round(time.perf_counter() - t0, 1))
    print(json.dumps(res), flush=True)
    del llm
