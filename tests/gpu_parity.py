"""Step-by-step parity of two engines' greedy runs on the same weights, one of them still alive
to restart where the runs fork at a near tie (tests/test_gpu_e2e.py; tests/test_gpu_parity_helper.py
checks it with a scripted engine). Imports nothing from blitzllm or torch."""
from __future__ import annotations

import dataclasses

TOL = 0.05  # logprobs agree within this; two tokens within it of each other are a near tie
# Two bf16 engines against each other (a fast path and the reference engine, each with its own
# summation orders): five steps of a bf16 logit between 4 and 8, where the dummy presets' logits
# lie (their logprobs come in steps of 1/32). Seen on an H100: 3 and 4 steps apart after 9 to 14
# decode steps (deepseek-v3, deepseek-v3.2 past index_topk, qwen3.5-4b), which TOL failed; a wrong
# kernel (the GDN decode that ran with beta 1) parted at the first decode step.
BF16_TOL = 5 / 32


def assert_runs_agree(llm, prompts, got, want, params, tol: float = TOL) -> list:
    """``got``: ``llm``'s greedy outputs for ``prompts`` (token-id lists; each output with
    ``token_ids`` and ``logprobs``, a {token id: logprob} dict per step); ``want``: another
    engine's free runs of the same prompts with the same ``params``. Every step of ``want`` is
    compared:

    * the logprob ``llm`` gives ``want``'s token is within ``tol`` of ``want``'s own;
    * the tokens are equal, or the step is a near tie: both tokens in both steps' logprobs, each
      token's logprob within ``tol`` across the runs, and ``want``'s two within ``tol`` of each
      other (``llm``'s two may then be up to 2 * ``tol`` apart: each moved by up to ``tol``, in
      opposite directions). There ``llm`` restarts, teacher-forced on the
      prompt plus ``want``'s tokens through that step, for ``want``'s remaining steps (``want``'s
      free run is conditioned on its own tokens, so its later logprobs stay the targets);
    * at most max(1, n // 4) such forks in a sequence of n tokens: more near ties than that
      points at a wrong kernel rather than rounding. A fork where ``llm`` gave both tokens the very
      same logprob is not counted: there its argmax broke an exact tie by token id, as any
      greedy sampler must (seen on an H100: qwen3.5-397b-a17b's dummy preset, a 248K vocabulary of
      flat bf16 logits, with three tokens tied at the top, failed one run in four on the fifth
      such fork, the two engines' logprobs there within 1/32).

    ``got`` is compared as produced (its batch); only the restarts are new ``generate`` calls,
    one prompt each. Returns the forks, (sequence index, step) pairs."""
    assert len(prompts) == len(got) == len(want), (len(prompts), len(got), len(want))
    forks = []
    for k, (prompt, run, w) in enumerate(zip(prompts, got, want)):
        n, start, seq_forks, counted = len(w.token_ids), 0, [], 0
        limit = max(1, n // 4)
        while True:
            ids, lps = run.token_ids, run.logprobs
            assert len(ids) == n - start, (f"sequence {k}: {len(ids)} tokens from step {start}, want {n - start}: "
                                           f"{ids} vs {w.token_ids[start:]}; logprobs {lps} vs {w.logprobs[start:]}")
            d = None
            for i, t in enumerate(ids):
                s = start + i
                b, lg, lw = w.token_ids[s], lps[i], w.logprobs[s]
                ctx = f"sequence {k} step {s} (forks at {seq_forks}): tokens {t} vs {b}; logprobs {lg} vs {lw}"
                assert b in lg and abs(lg[b] - lw[b]) < tol, f"logprobs differ: {ctx}"
                if t != b:
                    assert t in lw and abs(lg[t] - lw[t]) < tol and abs(lw[t] - lw[b]) < tol, f"not a near tie: {ctx}"
                    if lg[t] != lg[b]:
                        assert counted < limit, f"more than {limit} near-tie forks: {ctx}"
                        counted += 1
                    d = s
                    break
            if d is None:
                break
            seq_forks.append(d)
            start = d + 1
            if start == n:
                break
            forced = list(prompt) + list(w.token_ids[:start])
            run = llm.generate([forced], dataclasses.replace(params, max_tokens=n - start))[0]
        forks += [(k, d) for d in seq_forks]
    return forks
