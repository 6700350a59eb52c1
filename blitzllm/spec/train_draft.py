"""``blitz train-draft``: trains an EAGLE-3 head online from the engine's own hidden states.

The engine answers the prompts (greedy, batched), then runs one prefill per prompt +
answer (prefix caching off) while ``HiddenCapture`` records the target features of every
position of that exact engine forward (0..N-2). The head trains on each sequence as soon
as its features arrive (EAGLE objective:
features at t + token t+1 -> token t+2, with a few training-time-test steps, each feeding
the previous step's output back as the hidden input); later epochs replay the kept
sequences. Writes the folder that ``speculative_config={"method": "eagle3", "model": DIR}``
loads.
"""
from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .eagle3 import Eagle3Head, HiddenCapture

STEP_DECAY = 0.8   # loss weight of draft step j: STEP_DECAY ** j


@dataclass
class Sample:
    feats: torch.Tensor    # [N-1, 3H] target features of positions 0..N-2
    tokens: torch.Tensor   # [N] prompt + answer
    prompt_len: int


def parse_range(text: Optional[str]) -> Optional[tuple]:
    if text is None:
        return None
    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError:
        raise ValueError(f"--prompt-range must look like 81-140, got {text!r}") from None
    if lo > hi:
        raise ValueError(f"--prompt-range start {lo} is after its end {hi}")
    return lo, hi


def load_prompts(path: str, id_range: Optional[tuple] = None) -> list:
    """First turns of an MT-bench style JSONL ({"question_id", "turns": [...]}) or "prompt"
    / "text" fields; ``id_range`` (lo, hi) keeps question ids lo..hi inclusive."""
    out = []
    try:
        f = open(path)
    except OSError as e:
        raise ValueError(f"--prompts: cannot read {path!r}: {e.strerror}") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"--prompts: line {n} of {path} is not JSON") from None
            qid = d.get("question_id", n)
            if id_range is not None and not id_range[0] <= qid <= id_range[1]:
                continue
            text = d["turns"][0] if d.get("turns") else d.get("prompt", d.get("text"))
            if not isinstance(text, str):
                raise ValueError(f"--prompts: line {n} has no 'turns', 'prompt' or 'text'")
            out.append((qid, text))
    if not out:
        raise ValueError(f"--prompts: no prompts in {path}" + (f" with ids {id_range[0]}-{id_range[1]}"
                                                                 if id_range else ""))
    return out


def prompt_ids(llm, text: str) -> list:
    tok = llm.tokenizer
    if tok is not None and getattr(tok, "chat_template", None):
        return llm.apply_chat_template([{"role": "user", "content": text}])
    return llm.engine.tokenize(text)


def generate_answers(llm, prompts: list, max_tokens: int) -> list:
    """Greedy answers (token ids) of one batch of prompts (token id lists)."""
    from ..sampling_params import SamplingParams
    outs = llm.generate([list(p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [list(o.outputs[0].token_ids) for o in outs]


def capture_features(llm, cap: HiddenCapture, ids: list, prompt_len: int) -> Sample:
    """One engine prefill over prompt + answer (prefix caching off, so every position is
    forwarded; chunks of a long prefill are concatenated) -> the features of positions
    0..N-2 (the last token's are never needed)."""
    from ..sampling_params import SamplingParams
    cap.take()
    llm.generate([list(ids[:-1])], SamplingParams(temperature=0.0, max_tokens=1))
    feats, pos = cap.take()
    n = len(ids) - 1
    if feats is None or feats.shape[0] != n or not torch.equal(pos.cpu(), torch.arange(n)):
        raise RuntimeError("hidden-state capture did not see positions 0..N-2 exactly once "
                           "(is prefix caching on?)")
    return Sample(feats, torch.tensor(ids), prompt_len)


def sample_loss(head: Eagle3Head, s: Sample, steps: int) -> tuple:
    """Weighted loss over draft steps and per-step (correct, count) of top-1 predictions of
    answer tokens. Row t of step j predicts token t + 2 + j."""
    dev = head.fc.weight.device
    N = s.tokens.shape[0]
    T = N - 2
    if T <= 0:
        return None, []
    toks = s.tokens.to(dev)
    padded = torch.cat([toks[1:], toks.new_zeros(steps)])
    outs = head.forward_steps(s.feats[:T].to(dev), padded, steps)
    t = torch.arange(T, device=dev)
    loss, stats = 0.0, []
    for j, o in enumerate(outs):
        tgt = t + 2 + j
        keep = (tgt < N) & (tgt >= s.prompt_len)
        if not bool(keep.any()):
            stats.append((0, 0))
            continue
        logits = head.logits(o[keep])
        y = toks[tgt[keep]]
        loss = loss + STEP_DECAY ** j * F.cross_entropy(logits, y)
        stats.append((int((logits.argmax(-1) == y).sum()), int(keep.sum())))
    return (loss if torch.is_tensor(loss) else None), stats


def train_on(head, opt, s: Sample, steps: int) -> tuple:
    head.train()
    loss, stats = sample_loss(head, s, steps)
    if loss is None:
        return 0.0, stats
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in head.parameters() if p.requires_grad], 1.0)
    opt.step()
    return float(loss.detach()), stats


def make_optimizer(head: Eagle3Head, lr: float):
    return torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)


def _fmt(stats) -> str:
    return " ".join(f"{c / n:.2f}" if n else "-" for c, n in stats)


def train_draft(llm, prompts: list, out: Optional[str], epochs: int = 1, max_tokens: int = 256,
                lr: float = 1e-3, steps: int = 3, seed: int = 0, batch: int = 16, log=print) -> Eagle3Head:
    """``llm``: an ``LLM`` built with prefix caching off. Epoch 1 is online: the engine
    answers ``batch`` prompts at a time (batched greedy decode), then each prompt + answer
    goes through one engine prefill with the capture hooks on and the head trains on it;
    later epochs replay the kept sequences."""
    torch.manual_seed(seed)
    eng = llm.engine
    target = eng.runner.model
    head = Eagle3Head.from_target(target, eng.model_config).to(eng.device)
    opt = make_optimizer(head, lr)
    kept, t0, gen_s = [], time.perf_counter(), 0.0
    ids = [prompt_ids(llm, text) for _, text in prompts]
    with HiddenCapture(target, head.config.layer_ids) as cap:
        for b in range(0, len(prompts), batch):
            g0 = time.perf_counter()
            answers = generate_answers(llm, ids[b:b + batch], max_tokens)
            gen_s += time.perf_counter() - g0
            for i, (p, a) in enumerate(zip(ids[b:b + batch], answers), b):
                s = capture_features(llm, cap, p + a, len(p))
                kept.append(s)
                loss, stats = train_on(head, opt, s, steps)
                log(f"[train-draft] epoch 1 prompt {i + 1}/{len(prompts)} (id {prompts[i][0]}): "
                    f"{len(a)} answer tok, loss {loss:.3f}, top-1 per step {_fmt(stats)}, "
                    f"{time.perf_counter() - t0:.0f}s")
    rng = random.Random(seed)
    for ep in range(2, epochs + 1):
        order = list(range(len(kept)))
        rng.shuffle(order)
        tot, agg = 0.0, [[0, 0] for _ in range(steps)]
        for i in order:
            loss, stats = train_on(head, opt, kept[i], steps)
            tot += loss
            for a, (c, n) in zip(agg, stats):
                a[0] += c
                a[1] += n
        log(f"[train-draft] epoch {ep}: mean loss {tot / len(kept):.3f}, top-1 per step {_fmt(agg)}, "
            f"{time.perf_counter() - t0:.0f}s")
    head.eval()
    wall = time.perf_counter() - t0
    log(f"[train-draft] done: {len(kept)} prompts, {sum(len(s.tokens) - s.prompt_len for s in kept)} answer "
        f"tokens, {epochs} epoch(s), wall {wall:.1f}s (generation {gen_s:.1f}s)")
    if out:
        head.save(out)
        log(f"[train-draft] wrote {out}")
    return head


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
    p.set_defaults(func=cmd_train_draft)


def cmd_train_draft(a) -> int:
    from ..llm import LLM
    for name in ("epochs", "max_tokens", "steps", "batch"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if not a.lr > 0:
        raise ValueError(f"--lr must be > 0, got {a.lr}")
    prompts = load_prompts(a.prompts, parse_range(a.prompt_range))
    llm = LLM(a.model, device=a.device, dtype=a.dtype, enable_prefix_caching=False, seed=a.seed)
    train_draft(llm, prompts, a.out, epochs=a.epochs, max_tokens=a.max_tokens, lr=a.lr, steps=a.steps,
                seed=a.seed, batch=a.batch, log=lambda m: print(m, file=sys.stderr, flush=True))
    return 0
