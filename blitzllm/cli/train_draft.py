"""``blitz train-draft``: the command line of ``spec/train_draft.py`` (which trains an EAGLE-3 head
from an engine's hidden states), and the evaluation of a trained head through
``speculative_config`` on a fresh engine."""
from __future__ import annotations

import json
import sys
import time

from ..llm import LLM
from ..sampling_params import SamplingParams
from ..spec.train_draft import LOOP_REPEATS, STEP_DECAY, load_prompts, parse_range, prompt_ids, train_draft


def evaluate_head(model: str, head_dir: str, prompts: list, k: int, max_tokens: int, device=None,
                  dtype: str = "float32", log=print) -> dict:
    """Greedy answers to ``prompts`` with ``speculative_config={"method": "eagle3", ...}`` on a
    fresh engine: returns the engine's speculative counters (mean acceptance length etc.)."""
    llm = LLM(model, device=device, dtype=dtype,
              speculative_config={"method": "eagle3", "model": head_dir, "num_speculative_tokens": k})
    ids = [prompt_ids(llm, text) for _, text in prompts]
    t0 = time.perf_counter()
    llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    st = llm.stats()
    res = {key: st[key] for key in ("spec_draft_tokens", "spec_accepted_tokens", "spec_acceptance_per_position",
                                    "spec_mean_acceptance_length")}
    res["eval_max_tokens"] = max_tokens
    log(f"[train-draft] eval: {len(prompts)} prompts (ids {prompts[0][0]}-{prompts[-1][0]}), greedy, k={k}, "
        f"{max_tokens} tokens max: mean acceptance length {res['spec_mean_acceptance_length']:.3f}, "
        f"per position {' '.join(f'{a:.3f}' for a in res['spec_acceptance_per_position'])}, "
        f"{time.perf_counter() - t0:.1f}s")
    return res


# ---- CLI ----------------------------------------------------------------------------
def add_train_draft_args(p) -> None:
    p.add_argument("--model", required=True, help="target model (path, HF name or preset)")
    p.add_argument("--prompts", required=True, help="JSONL of prompts (MT-bench: first turn of each)")
    p.add_argument("--out", required=True, help="folder to write the head to")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=256, help="answer length cap per prompt")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=3, help="training-time-test draft steps")
    p.add_argument("--prompt-range", default=None, help="question ids to use, e.g. 81-140")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=16, help="prompts the engine answers at once")
    p.add_argument("--samples-per-prompt", type=int, default=1,
                   help="answers per prompt: the greedy one, then sampled ones at --temperature")
    p.add_argument("--temperature", type=float, default=0.8, help="for the sampled answers")
    p.add_argument("--branch", action="store_true",
                   help="answers after the first: the greedy answer up to a random point, one token sampled "
                        "at --temperature, then greedy again (instead of wholly sampled answers)")
    p.add_argument("--copy-spans", type=int, default=0,
                   help="per answer, also train on N sequences of the answer followed by a copy of a random span "
                        "of it (loss on the copy: how the target continues text it repeats)")
    p.add_argument("--loop-spans", type=int, default=0,
                   help="per answer, also train on N sequences ending in a loop of a shuffled span of it "
                        f"({LOOP_REPEATS} repeats, loss on the repeats after the first: labels the head can fit only "
                        "by copying from its context, as the target does in the loops of greedy answers)")
    p.add_argument("--copy-input", action="store_true",
                   help="give the head a copy input: per position the embedding of the token that followed the last "
                        "earlier occurrence of its longest suffix n-gram (n <= 3, what prompt lookup finds), times a "
                        "learned gate per n, added to its layer output")
    p.add_argument("--labels", choices=("target", "tokens"), default="target",
                   help="train on the target's next-token distributions (distillation; default) "
                        "or on the answer tokens")
    p.add_argument("--no-feature-norm", dest="feature_norm", action="store_false",
                   help="feed the raw target features to the head's fc (heads before the per-feature RMSNorm)")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="predict over the N most frequent tokens of the first batch's prompts and answers only "
                        "(a reduced draft vocabulary mapped back to the target's; 0: the target's whole vocabulary)")
    p.add_argument("--step-decay", type=float, default=STEP_DECAY,
                   help="loss weight of training-time-test step j is step_decay ** j")
    p.add_argument("--draft-intermediate", type=int, default=0,
                   help="the head's MLP width (default 0: the target's intermediate size)")
    p.add_argument("--init-layer", action="store_true",
                   help="start the head's decoder layer as a copy of the target's last decoder layer")
    p.add_argument("--layer-ids", default=None,
                   help="the three target layers whose outputs feed the head, e.g. 1,14,29 "
                        "(default: 1, L/2 - 1, L - 4)")
    p.add_argument("--eval-range", default=None,
                   help="after training, run these question ids greedily with the head through "
                        "speculative_config and report the mean acceptance length, e.g. 141-160")
    p.add_argument("--eval-k", type=int, default=3, help="num_speculative_tokens for --eval-range")
    p.add_argument("--eval-max-tokens", default="128",
                   help="answer length cap of the evaluation; a comma-separated list (e.g. 128,1024) evaluates "
                        "each on a fresh engine and prints a JSON line per length")
    p.set_defaults(func=cmd_train_draft)


def cmd_train_draft(a) -> int:
    try:
        eval_lens = [int(x) for x in str(a.eval_max_tokens).split(",")]
    except ValueError:
        raise ValueError(f"--eval-max-tokens must be integers separated by commas, got {a.eval_max_tokens!r}") from None
    if min(eval_lens) < 1:
        raise ValueError(f"--eval-max-tokens must be >= 1, got {a.eval_max_tokens}")
    for name, lo in (("epochs", 1), ("max_tokens", 1), ("steps", 1), ("batch", 1), ("samples_per_prompt", 1),
                     ("eval_k", 1), ("copy_spans", 0), ("loop_spans", 0)):
        if getattr(a, name) < lo:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {lo}, got {getattr(a, name)}")
    if a.draft_vocab < 0:
        raise ValueError(f"--draft-vocab must be >= 0 (0: the target's whole vocabulary), got {a.draft_vocab}")
    if not a.lr > 0:
        raise ValueError(f"--lr must be > 0, got {a.lr}")
    if not 0 < a.step_decay <= 1:
        raise ValueError(f"--step-decay must be in (0, 1], got {a.step_decay}")
    if not a.temperature > 0:
        raise ValueError(f"--temperature must be > 0, got {a.temperature}")
    layer_ids = None
    if a.layer_ids is not None:
        try:
            layer_ids = [int(x) for x in a.layer_ids.split(",")]
        except ValueError:
            raise ValueError(f"--layer-ids must be comma-separated integers, got {a.layer_ids!r}") from None
    prompts = load_prompts(a.prompts, parse_range(a.prompt_range))
    eval_prompts = load_prompts(a.prompts, parse_range(a.eval_range)) if a.eval_range else None
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    llm = LLM(a.model, device=a.device, dtype=a.dtype, enable_prefix_caching=False, seed=a.seed)
    train_draft(llm, prompts, a.out, epochs=a.epochs, max_tokens=a.max_tokens, lr=a.lr, steps=a.steps,
                seed=a.seed, batch=a.batch, samples=a.samples_per_prompt, temperature=a.temperature,
                layer_ids=layer_ids, labels=a.labels, feature_norm=a.feature_norm, init_layer=a.init_layer,
                step_decay=a.step_decay, draft_vocab=a.draft_vocab, draft_intermediate=a.draft_intermediate,
                branch=a.branch, copy_spans=a.copy_spans, loop_spans=a.loop_spans, copy_input=a.copy_input, log=log)
    if eval_prompts:
        del llm
        for n in eval_lens:
            res = evaluate_head(a.model, a.out, eval_prompts, a.eval_k, n, a.device, a.dtype, log)
            print(json.dumps(res), flush=True)
    return 0
