"""A request's checks against the model before it is queued, and what they resolve: the prompt's
token ids (truncated as ``truncate_prompt_tokens`` asks, in the vocabulary, leaving room to
generate), the params' token ids in the vocabulary, the generation config's cap on ``max_tokens``,
and ``bad_words`` as token id sequences; a priority against the scheduling policy.
"""
from __future__ import annotations

from typing import Optional

from ..sampling_params import SamplingParams

# Each step checks every spelling of every bad word on the host: bounded, as vLLM bounds them.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 1024   # over all spellings
MAX_BAD_WORD_CHARS = 16 * MAX_BAD_WORD_TOKENS   # (checked first: the engine thread tokenizes them)


def truncated(ids: list, k: Optional[int], max_model_len: int) -> list:
    """The prompt's last ``k`` tokens (-1: max_model_len; None: all), as vLLM truncates."""
    if k is None:
        return ids
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens ({k}) must be at most max_model_len={max_model_len}")
    return ids[-(max_model_len if k == -1 else k):]


def bad_word_ids(words, tokenizer, vocab_size: int) -> tuple:
    """Each word as the tokenizer spells it alone and after a space (mid-text), without special
    tokens; duplicates dropped."""
    if tokenizer is None:
        raise ValueError("bad_words needs the model's tokenizer (this model has none)")
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words takes at most {MAX_BAD_WORDS} words, got {len(words)}")
    if sum(map(len, words)) > MAX_BAD_WORD_CHARS:
        raise ValueError(f"bad_words hold {sum(map(len, words))} characters; at most {MAX_BAD_WORD_CHARS} are taken")
    out = []
    for w in words:
        for text in (w.lstrip(), " " + w.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    if sum(map(len, out)) > MAX_BAD_WORD_TOKENS:
        raise ValueError(f"bad_words spell {sum(map(len, out))} tokens (alone and after a space); at most "
                         f"{MAX_BAD_WORD_TOKENS} are taken")
    if any(t >= vocab_size for ids in out for t in ids):
        raise ValueError(f"bad_words tokenize to ids past the model's vocabulary ({vocab_size})")
    return tuple(out)


def check_request(ids: list, params: SamplingParams, *, vocab_size: int, max_model_len: int,
                  max_tokens_cap: Optional[int], tokenizer, max_logprobs: int) -> tuple:
    """(prompt ids, params, bad word ids) for the engine to queue, or a ValueError saying what is
    wrong. ``max_logprobs``: the engine's cap on logprobs / prompt_logprobs (-1: the vocabulary)."""
    ids = truncated(ids, params.truncate_prompt_tokens, max_model_len)
    V = vocab_size
    check_logprobs(params, max_logprobs, V)
    if not ids:
        raise ValueError("the prompt is empty")
    if any(t < 0 or t >= V for t in ids):
        raise ValueError(f"prompt token ids must be in [0, {V})")
    if len(ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(ids)} tokens, which leaves no room to generate within "
                         f"max_model_len={max_model_len}")
    if params.max_tokens is not None and len(ids) + params.max_tokens > max_model_len:
        raise ValueError(f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                         f"max_model_len={max_model_len}")
    if params.max_tokens is None and max_tokens_cap is not None:  # the generation config's max_new_tokens
        params = params.clone(max_tokens=min(max_tokens_cap, max_model_len - len(ids)))
    for name in ("stop_token_ids", "allowed_token_ids"):
        if any(t >= V for t in getattr(params, name) or ()):
            raise ValueError(f"{name} must be in [0, {V})")
    if params.logit_bias and max(params.logit_bias) >= V:
        raise ValueError(f"logit_bias token ids must be in [0, {V})")
    bad = bad_word_ids(params.bad_words, tokenizer, V) if params.bad_words else ()
    return ids, params, bad


def logprobs_cap(max_logprobs: int, vocab_size: int) -> int:
    return vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)


def check_logprobs(params: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    cap = logprobs_cap(max_logprobs, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > cap:
            raise ValueError(f"{name} must be at most {cap} (the engine's max_logprobs), got {k}")


def check_priority(priority, policy: str) -> None:
    """A request's priority: an integer, and other than 0 only under the priority policy (as vLLM
    answers it: a priority the scheduler would ignore is the caller's mistake, not a no-op)."""
    if not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) > 2**63 - 1:
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority and policy != "priority":
        raise ValueError(f"priority {priority} needs priority scheduling, which is not enabled "
                         "(scheduling_policy 'priority', --scheduling-policy priority)")
