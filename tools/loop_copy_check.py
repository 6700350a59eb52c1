#!/usr/bin/env python3
"""Does the target copy inside the loops that ``train-draft --loop-spans`` builds? For each
prompt: the greedy answer (96 tokens), then prompt + a prefix of the answer + a shuffled span of
it repeated three times, and prompt + answer + a copy of a span; one capture forward each (the
engine's own, as train-draft runs it) and the target's argmax at every position of the second
and third repeats and of the copy: the fraction that is the copied token.

    python3 tools/loop_copy_check.py [--model smollm2] [--range 81-88]
"""
import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from blitzllm.llm import LLM  # noqa: E402
from blitzllm.sampling_params import SamplingParams  # noqa: E402
from blitzllm.spec.eagle3 import _target_embed_lm_head, default_layer_ids  # noqa: E402
from blitzllm.spec.hidden import HiddenCapture  # noqa: E402
from blitzllm.spec.train_draft import capture_features, load_prompts, parse_range, prompt_ids  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="smollm2")
ap.add_argument("--prompts", default="blitzllm/bench/data/mt_bench_questions.jsonl")
ap.add_argument("--range", default="81-88")
a = ap.parse_args()
llm = LLM(a.model, device="cpu", dtype="float32", enable_prefix_caching=False)
eng = llm.engine
target = eng.runner.model
_, lm = _target_embed_lm_head(target, eng.model_config)
W = (lm.weight if hasattr(lm, "weight") else lm).float()
ids = [prompt_ids(llm, t) for _, t in load_prompts(a.prompts, parse_range(a.range))]
outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=96))
rng = random.Random(0)
tot = {"loop, 2nd repeat": [0, 0], "loop, 3rd repeat": [0, 0], "copy of a span": [0, 0]}
with HiddenCapture(target, default_layer_ids(eng.model_config.num_layers), keep_final=True) as cap:
    for p, o in zip(ids, outs):
        ans = list(o.outputs[0].token_ids)
        n = rng.randint(12, 32)
        i = rng.randint(0, len(ans) - n)
        span = ans[i:i + n]
        rng.shuffle(span)
        base = p + ans[:rng.randint(len(ans) // 2, len(ans))]
        for kind, seq, start, loss_from in (("loop", base + span * 3, len(base) + n, len(base)),
                                            ("copy", p + ans + ans[i:i + n], len(p) + len(ans), len(p))):
            s = capture_features(llm, cap, seq, loss_from)
            pred = (s.final.float() @ W.t()).argmax(-1)   # row r: the target's token for position loss_from + r
            for pos in range(start, len(seq)):
                key = "copy of a span" if kind == "copy" else \
                    ("loop, 2nd repeat" if pos < start + n else "loop, 3rd repeat")
                tot[key][0] += int(pred[pos - loss_from] == seq[pos])
                tot[key][1] += 1
for k, (c, m) in tot.items():
    print(f"{k}: the target's argmax is the copied token at {c / m:.3f} of {m} positions")
