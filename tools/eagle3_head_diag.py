#!/usr/bin/env python3
"""What an EAGLE-3 head's first draft position knows, on held-out greedy answers (CPU).

    python3 tools/eagle3_head_diag.py HEAD_DIR [--model smollm2] [--train 81-100] [--eval 141-150] [--max-tokens 128]

For each position of the target's greedy answers to the --eval prompts, whether the head's
step-0 draft equals the target's next token (what greedy verification accepts at position 1),
fed with: the real target features ("real"), zeros ("zero"), or the features of a random
other position of the same answer ("shuffled"). Beside it two feature-free predictors of the
same token: the most frequent successor of the current token in the target's greedy answers
to the --train prompts ("bigram"), and the token that followed the current token's last
earlier occurrence in prompt + answer ("copy", the lookup prompt-lookup decoding does with
n = 1). Prints the fraction correct of each.
"""
import argparse
import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("head")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", default=os.path.join(ROOT, "blitzllm", "bench", "data", "mt_bench_questions.jsonl"))
    ap.add_argument("--train", default="81-100", help="question ids whose greedy answers give the bigram table")
    ap.add_argument("--eval", default="141-150")
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    import torch
    from blitzllm.llm import LLM
    from blitzllm.sampling_params import SamplingParams
    from blitzllm.spec.eagle3 import Eagle3Head
    from blitzllm.spec.hidden import HiddenCapture
    from blitzllm.spec.train_draft import capture_features, load_prompts, parse_range, prompt_ids
    torch.manual_seed(0)
    llm = LLM(a.model, enable_prefix_caching=False)
    target = llm.engine.runner.model
    head = Eagle3Head.load(a.head, target=target, target_cfg=llm.engine.model_config)

    def answers(ids_range):
        ids = [prompt_ids(llm, text) for _, text in load_prompts(a.prompts, parse_range(ids_range))]
        outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=a.max_tokens))
        return [(p, list(o.outputs[0].token_ids)) for p, o in zip(ids, outs)]

    bigram = collections.defaultdict(collections.Counter)
    for p, ans in answers(a.train):
        seq = p + ans
        for i in range(len(p) - 1, len(seq) - 1):
            bigram[seq[i]][seq[i + 1]] += 1
    hits, counts = collections.Counter(), collections.Counter()
    with HiddenCapture(target, head.config.layer_ids, keep_final=True) as cap, torch.no_grad():
        for p, ans in answers(a.eval):
            s = capture_features(llm, cap, p + ans, len(p))
            toks = s.tokens
            T = len(toks) - 2
            rows = [t for t in range(T) if t + 2 >= len(p)]   # row t drafts the token at t + 2
            feats = s.feats[:T]
            for name, f in (("real", feats), ("zero", torch.zeros_like(feats)),
                            ("shuffled", feats[torch.randperm(T)])):
                out = head.forward_steps(f, torch.cat([toks[1:], toks.new_zeros(1)]), 1)[0]
                pred = head.draft_tokens(head.logits(out))
                hits[name] += sum(int(pred[t] == toks[t + 2]) for t in rows)
                counts[name] += len(rows)
            for t in rows:
                cur, want = int(toks[t + 1]), int(toks[t + 2])
                c = bigram.get(cur)
                hits["bigram"] += int(c is not None and c.most_common(1)[0][0] == want)
                prev = [i for i in range(t + 1) if int(toks[i]) == cur]
                hits["copy"] += int(bool(prev) and int(toks[prev[-1] + 1]) == want)
                counts["bigram"] += 1
                counts["copy"] += 1
    print(f"step-0 drafts equal to the target's greedy token, prompts {a.eval}, {a.max_tokens} tokens max:")
    for name in ("real", "zero", "shuffled", "bigram", "copy"):
        print(f"  {name:9s} {hits[name] / max(1, counts[name]):.3f}  ({counts[name]} positions)")


if __name__ == "__main__":
    main()
