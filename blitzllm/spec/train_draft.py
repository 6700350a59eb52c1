"""Trains an EAGLE-3 draft head online from an engine's own hidden states: the library behind
``blitz train-draft`` (command line: ``cli/train_draft.py``), writing the folder that
``{"method": "eagle3", "model": DIR}`` loads (docs/speculative.md#training-a-head).
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .eagle3 import Eagle3Head, copy_candidates
from .hidden import HiddenCapture

STEP_DECAY = 0.8   # default loss weight of draft step j: STEP_DECAY ** j (--step-decay)


@dataclass
class Sample:
    feats: torch.Tensor    # [N-1, 3H] target features of positions 0..N-2
    tokens: torch.Tensor   # [N] prompt + answer
    prompt_len: int
    final: Optional[torch.Tensor] = None   # [N-1, H] target outputs (final-normed) of positions 0..N-2
    copy: Optional[tuple] = None   # copy_candidates of tokens (heads with the copy input; made once)


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


def generate_answers(llm, prompts: list, max_tokens: int, samples: int = 1, temperature: float = 0.8,
                     seed: int = 0, branch: bool = False) -> list:
    """[(prompt index, answer ids)] of one batch of prompts: per prompt the greedy answer, then
    ``samples - 1`` answers sampled at ``temperature`` (seeded); with ``branch`` those are the
    greedy answer up to a random point, one token sampled there, then greedy again."""
    from ..sampling_params import SamplingParams
    if branch and samples > 1:
        return _branched_answers(llm, prompts, max_tokens, samples, temperature, seed)
    reqs, params, owner = [], [], []
    for i, p in enumerate(prompts):
        for j in range(samples):
            reqs.append(list(p))
            owner.append(i)
            params.append(SamplingParams(temperature=0.0 if j == 0 else temperature, max_tokens=max_tokens,
                                         seed=seed * 1_000_003 + i * 1009 + j))
    outs = llm.generate(reqs, params)
    return [(i, list(o.outputs[0].token_ids)) for i, o in zip(owner, outs)]


def _branched_answers(llm, prompts: list, max_tokens: int, samples: int, temperature: float, seed: int) -> list:
    """generate_answers with ``branch``: three batched engine calls (the greedy answers, the
    sampled turn of every branch, the greedy continuations)."""
    from ..sampling_params import SamplingParams
    greedy = [list(o.outputs[0].token_ids) for o in
              llm.generate([list(p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens))]
    rng = random.Random(seed * 1_000_003 + 17)
    cuts, reqs, params = [], [], []
    for i, (p, g) in enumerate(zip(prompts, greedy)):
        for j in range(1, samples):
            c = rng.randrange(len(g)) if g else 0
            cuts.append((i, c))
            reqs.append(list(p) + g[:c])
            params.append(SamplingParams(temperature=temperature, max_tokens=1,
                                         seed=seed * 1_000_003 + i * 1009 + j))
    turns = [list(o.outputs[0].token_ids) for o in llm.generate(reqs, params)] if reqs else []
    heads = [greedy[i][:c] + t for (i, c), t in zip(cuts, turns)]
    eos = set(llm.engine.eos_token_ids)
    rest = [(k, max_tokens - len(h)) for k, h in enumerate(heads) if max_tokens - len(h) > 0
            and not (turns[k] and turns[k][-1] in eos)]  # a sampled end of answer ends it
    conts = {}
    if rest:
        outs = llm.generate([list(prompts[cuts[k][0]]) + heads[k] for k, _ in rest],
                            [SamplingParams(temperature=0.0, max_tokens=n) for _, n in rest])
        conts = {k: list(o.outputs[0].token_ids) for (k, _), o in zip(rest, outs)}
    out = []
    for i, g in enumerate(greedy):
        out.append((i, g))
        out += [(cuts[k][0], heads[k] + conts.get(k, [])) for k in range(len(heads)) if cuts[k][0] == i]
    return out


def copy_span_sequence(prompt: list, answer: list, rng: random.Random, min_len: int = 8) -> Optional[list]:
    """prompt + answer + a copy of one random span of it (``min_len`` tokens to the whole answer),
    or None for a shorter answer: text where the target continues by copying."""
    if len(answer) < min_len:
        return None
    n = rng.randint(min_len, len(answer))
    i = rng.randint(0, len(answer) - n)
    return list(prompt) + list(answer) + list(answer[i:i + n])


LOOP_REPEATS = 3   # a loop sequence's span appears this many times


def loop_span_sequence(prompt: list, answer: list, rng: random.Random, min_len: int = 8,
                       max_len: int = 48) -> Optional[tuple]:
    """(prompt + the answer up to a random cut + S repeated LOOP_REPEATS times, where the loss
    starts: after the first S), S a shuffled random span of the answer; None for an answer
    shorter than ``min_len``. The head can fit those labels only by copying from its context."""
    if len(answer) < min_len:
        return None
    n = rng.randint(min_len, min(max_len, len(answer)))
    i = rng.randint(0, len(answer) - n)
    span = list(answer[i:i + n])
    rng.shuffle(span)
    cut = rng.randint(0, len(answer))
    head = list(prompt) + list(answer[:cut])
    return head + span * LOOP_REPEATS, len(head) + n


def capture_features(llm, cap: HiddenCapture, ids: list, prompt_len: int) -> Sample:
    """One engine prefill over prompt + answer (prefix caching off, so every position is
    forwarded; chunks of a long prefill are concatenated) -> the features of positions
    0..N-2 (the last token's are never needed)."""
    from ..sampling_params import SamplingParams
    cap.take()
    llm.generate([list(ids[:-1])], SamplingParams(temperature=0.0, max_tokens=1))
    feats, pos, *final = cap.take()
    n = len(ids) - 1
    if feats is None or feats.shape[0] != n or not torch.equal(pos.cpu(), torch.arange(n)):
        raise RuntimeError("hidden-state capture did not see positions 0..N-2 exactly once "
                           "(is prefix caching on?)")
    # the target outputs are kept in half precision (their logits are recomputed per step)
    final = final[0][prompt_len - 1:].to(torch.bfloat16) if final and final[0] is not None else None
    return Sample(feats, torch.tensor(ids), prompt_len, final)


def choose_draft_vocab(token_lists: list, size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``token_lists`` (ties: lower id first; padded
    with the lowest unseen ids when fewer were seen), ascending: a draft vocabulary."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"--draft-vocab must be in [1, {vocab_size}] (the target vocabulary), got {size}")
    flat = [t for ts in token_lists for t in ts]
    counts = torch.bincount(torch.tensor(flat, dtype=torch.long), minlength=vocab_size)[:vocab_size] \
        if flat else torch.zeros(vocab_size, dtype=torch.long)
    order = torch.sort(-counts, stable=True).indices   # by count, then id
    return torch.sort(order[:size]).values


def sample_loss(head: Eagle3Head, s: Sample, steps: int, step_decay: float = STEP_DECAY) -> tuple:
    """Weighted loss over draft steps and per-step (correct, count) of top-1 predictions; row t of
    step j predicts token t + 2 + j. With the target's outputs (``s.final``) the label is its whole
    distribution at position t + 1 + j (distillation) and "correct" is its argmax (what greedy
    verification accepts); without, the token itself."""
    dev = head.fc.weight.device
    N = s.tokens.shape[0]
    T = N - 2
    if T <= 0:
        return None, []
    toks = s.tokens.to(dev)
    padded = torch.cat([toks[1:], toks.new_zeros(steps)])
    copy = None
    if head.config.copy_input:   # candidates of positions 1..N-1, padded like the tokens
        if s.copy is None:   # (each epoch replays the sample)
            s.copy = copy_candidates(s.tokens.tolist())
        cand, length = s.copy
        copy = (torch.tensor(cand[1:] + [0] * steps, device=dev), torch.tensor(length[1:] + [0] * steps, device=dev))
    outs = head.forward_steps(s.feats[:T].to(dev), padded, steps, copy)
    t = torch.arange(T, device=dev)
    reduced = bool(head.config.draft_vocab_size)
    if reduced:   # target id -> draft index (-1: not in the draft vocabulary)
        t2d = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=dev)
        t2d[head.d2t] = torch.arange(head.d2t.numel(), device=dev)
    loss, stats = 0.0, []
    for j, o in enumerate(outs):
        tgt = t + 2 + j
        keep = (tgt < N) & (tgt >= s.prompt_len)
        if not bool(keep.any()):
            stats.append((0, 0))
            continue
        logits = head.logits(o[keep])
        if s.final is not None:   # rows of s.final are positions prompt_len - 1 .. N-2
            with torch.no_grad():
                fin = s.final.to(dev)[tgt[keep] - 1 - (s.prompt_len - 1)].to(head.lm_head.weight.dtype)
                # over the draft vocabulary: the target's distribution restricted and renormalized
                p = torch.softmax(head.lm_head(fin).float(), -1)
                full = getattr(head, "full_lm_head", None) if reduced else None
                y = (fin @ full.t()).argmax(-1) if full is not None else head.draft_tokens(p)
            loss = loss + step_decay ** j * -(p * torch.log_softmax(logits, -1)).sum(-1).mean()
        else:
            y = toks[tgt[keep]]
            # (a reduced vocabulary cannot hit tokens outside it: those rows add no loss)
            yd = t2d[y] if reduced else y
            if bool((yd >= 0).any()):
                loss = loss + step_decay ** j * F.cross_entropy(logits, yd, ignore_index=-1)
        stats.append((int((head.draft_tokens(logits) == y).sum()), int(keep.sum())))
    return (loss if torch.is_tensor(loss) else None), stats


def train_on(head, opt, s: Sample, steps: int, step_decay: float = STEP_DECAY) -> tuple:
    head.train()
    loss, stats = sample_loss(head, s, steps, step_decay)
    if loss is None:
        return 0.0, stats
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in head.parameters() if p.requires_grad], 1.0)
    opt.step()
    return float(loss.detach()), stats


def make_optimizer(head: Eagle3Head, lr: float):
    return torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)


def lr_at(step: int, total: int, warmup: int) -> float:
    """Learning-rate factor: linear warm-up over ``warmup`` steps, then cosine decay to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac))


def _fmt(stats) -> str:
    return " ".join(f"{c / n:.2f}" if n else "-" for c, n in stats)


def train_draft(llm, prompts: list, out: Optional[str], epochs: int = 1, max_tokens: int = 256,
                lr: float = 1e-3, steps: int = 3, seed: int = 0, batch: int = 16, samples: int = 1,
                temperature: float = 0.8, layer_ids: Optional[list] = None, labels: str = "target",
                feature_norm: bool = True, init_layer: bool = False, step_decay: float = STEP_DECAY,
                draft_vocab: int = 0, draft_intermediate: int = 0, branch: bool = False, copy_spans: int = 0,
                loop_spans: int = 0, copy_input: bool = False, log=print) -> Eagle3Head:
    """Trains a head on ``llm`` (prefix caching off) with ``blitz train-draft``'s options
    (docs/speculative.md#training-a-head). Epoch 1 is online: the engine answers ``batch`` prompts
    at a time (``samples`` each, the first greedy; ``branch``: ``generate_answers``), each prompt +
    answer goes through one captured prefill and the head trains on it; later epochs replay the kept
    sequences. ``labels``: "target" (the capture forward's distributions) or "tokens"."""
    if labels not in ("target", "tokens"):
        raise ValueError(f"--labels must be 'target' or 'tokens', got {labels!r}")
    torch.manual_seed(seed)
    eng = llm.engine
    target = eng.runner.model
    if eng.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    if layer_ids is not None and (len(layer_ids) != 3 or not all(0 <= i < eng.model_config.num_layers
                                                                  for i in layer_ids)):
        raise ValueError(f"--layer-ids must be three target layers in [0, {eng.model_config.num_layers}), "
                         f"got {layer_ids}")
    if draft_intermediate < 0:
        raise ValueError(f"--draft-intermediate must be positive (or 0: the target's width), got {draft_intermediate}")
    head = Eagle3Head.from_target(target, eng.model_config, layer_ids, feature_norm=feature_norm,
                                  init_layer=init_layer, intermediate_size=draft_intermediate,
                                  copy_input=copy_input).to(eng.device)
    if draft_vocab and not 0 < draft_vocab <= head.config.vocab_size:
        raise ValueError(f"--draft-vocab must be in [1, {head.config.vocab_size}] (the target vocabulary) "
                         f"or 0, got {draft_vocab}")
    if copy_spans < 0:
        raise ValueError(f"--copy-spans must be >= 0, got {copy_spans}")
    if loop_spans < 0:
        raise ValueError(f"--loop-spans must be >= 0, got {loop_spans}")
    opt = make_optimizer(head, lr)
    per_answer = 1 + copy_spans + loop_spans
    total = epochs * len(prompts) * samples * per_answer
    copy_rng = random.Random(seed * 7919 + 1)
    n_copies = n_loops = 0
    warmup = max(1, total * 3 // 100)
    step = 0

    def train_step(s: Sample) -> tuple:
        nonlocal step
        for g in opt.param_groups:
            g["lr"] = lr * lr_at(step, total, warmup)
        step += 1
        return train_on(head, opt, s, steps, step_decay)

    def learn(seq: list, loss_from: int) -> tuple:
        s = capture_features(llm, cap, seq, loss_from)
        kept.append(s)
        return train_step(s)

    kept, t0, gen_s = [], time.perf_counter(), 0.0
    ids = [prompt_ids(llm, text) for _, text in prompts]
    with HiddenCapture(target, head.config.layer_ids, keep_final=labels == "target") as cap:
        for b in range(0, len(prompts), batch):
            g0 = time.perf_counter()
            answers = generate_answers(llm, ids[b:b + batch], max_tokens, samples, temperature, seed + b, branch)
            gen_s += time.perf_counter() - g0
            if draft_vocab and not head.config.draft_vocab_size:
                seen = ids[b:b + batch] + [a for _, a in answers]
                head.reduce_vocab(choose_draft_vocab(seen, draft_vocab, head.config.vocab_size))
                log(f"[train-draft] draft vocabulary: the {head.config.draft_vocab_size} most frequent of "
                    f"{sum(map(len, seen))} tokens seen (target vocabulary {head.config.vocab_size})")
            for i, a in answers:
                p = ids[b + i]
                loss, stats = learn(p + a, len(p))
                log(f"[train-draft] epoch 1 sample {len(kept)}/{len(prompts) * samples * per_answer} (prompt "
                    f"id {prompts[b + i][0]}): {len(a)} answer tok, loss {loss:.3f}, top-1 per step {_fmt(stats)}, "
                    f"{time.perf_counter() - t0:.0f}s")
                for _ in range(copy_spans):
                    seq = copy_span_sequence(p, a, copy_rng)
                    if seq is None:
                        continue
                    n_copies += 1
                    loss, stats = learn(seq, len(p) + len(a))   # loss on the copy only
                    log(f"[train-draft] epoch 1 sample {len(kept)} (copy of {len(seq) - len(p) - len(a)} answer "
                        f"tokens): loss {loss:.3f}, top-1 per step {_fmt(stats)}")
                for _ in range(loop_spans):
                    made = loop_span_sequence(p, a, copy_rng)
                    if made is None:
                        continue
                    seq, start = made
                    n_loops += 1
                    loss, stats = learn(seq, start)   # loss on the repeats
                    log(f"[train-draft] epoch 1 sample {len(kept)} (loop of a {(len(seq) - start) // (LOOP_REPEATS - 1)}"
                        f"-token span): loss {loss:.3f}, top-1 per step {_fmt(stats)}")
    rng = random.Random(seed)
    for ep in range(2, epochs + 1):
        order = list(range(len(kept)))
        rng.shuffle(order)
        tot, agg = 0.0, [[0, 0] for _ in range(steps)]
        for i in order:
            loss, stats = train_step(kept[i])
            tot += loss
            for a, (c, n) in zip(agg, stats):
                a[0] += c
                a[1] += n
        log(f"[train-draft] epoch {ep}: mean loss {tot / len(kept):.3f}, top-1 per step {_fmt(agg)}, "
            f"{time.perf_counter() - t0:.0f}s")
    head.eval()
    wall = time.perf_counter() - t0
    log(f"[train-draft] done: {len(prompts)} prompts, {len(kept) - n_copies - n_loops} answers"
        f"{f' + {n_copies} copy sequences' if n_copies else ''}{f' + {n_loops} loop sequences' if n_loops else ''}, "
        f"{sum(len(s.tokens) - s.prompt_len for s in kept)} trained tokens, {epochs} epoch(s), "
        f"wall {wall:.1f}s (generation {gen_s:.1f}s) on {_machine(eng.device)}")
    if out:
        head.save(out)
        log(f"[train-draft] wrote {out}")
    return head


def _machine(device) -> str:
    import os
    import platform
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"
