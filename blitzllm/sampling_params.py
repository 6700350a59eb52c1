"""Per-request sampling settings with vLLM's field names, validated at construction; how the
values are applied lives in ``layers/sampler.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

_MAX_SEED = 2**63 - 1
_GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (vLLM's bound too)
MAX_N = 128           # the most completions a server request may ask for


def sample_seed(seed: int, i: int) -> int:
    """The seed of completion ``i`` of a request seeded ``seed`` (the request's own for the first):
    the engine's rule, and the disaggregated router's when it splits ``n`` into requests of one."""
    return seed if i == 0 else (seed * 1_000_003 + i) % (2**63)


def _err(name: str, allowed: str, value) -> ValueError:
    return ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: Optional[int] = 16  # None: up to the context length; 0: no token (scoring with prompt_logprobs)
    min_tokens: int = 0
    stop: Union[None, str, Sequence[str]] = None
    stop_token_ids: Optional[Sequence[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # top-N logprobs per generated token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # {"type": "json_object"}, {"type": "json_schema", "schema": {...}}, regex, choice, grammar or
    # structural_tag: tokens constrained to it (blitzllm/structured.py; needs xgrammar)
    structured_output: Optional[dict] = None
    logit_bias: Optional[dict] = None  # {token id: bias in [-100, 100]}, added to the logits before sampling
    prompt_logprobs: Optional[int] = None  # per prompt token: its logprob and the top-N, from the prefill
    allowed_token_ids: Optional[Sequence[int]] = None  # only these tokens may be sampled
    # words (each also with a leading space) whose last token is banned where the tokens before it
    # were just generated: the text never holds them as the tokenizer spells them
    bad_words: Optional[Sequence[str]] = None
    truncate_prompt_tokens: Optional[int] = None  # keep the prompt's last k tokens (-1: max_model_len)

    def __post_init__(self) -> None:
        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if not is_num(v) or v != v:
                raise _err(name, "a number", v)
            setattr(self, name, float(v))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            # a truthy string ("false") would silently mean True
            if not isinstance(getattr(self, name), bool):
                raise _err(name, "true or false", getattr(self, name))
        if not is_int(self.n) or self.n < 1:
            raise _err("n", "an integer >= 1", self.n)
        if self.temperature < 0.0:
            raise _err("temperature", ">= 0", self.temperature)
        if self.temperature == float("inf"):
            raise _err("temperature", "finite", self.temperature)
        if self.temperature < _GREEDY_BELOW:
            # as greedy: logits over a tiny temperature overflow to inf (NaN probabilities)
            self.temperature = 0.0
        if not 0.0 < self.top_p <= 1.0:
            raise _err("top_p", "in (0, 1]", self.top_p)
        if not is_int(self.top_k) or self.top_k < -1:
            raise _err("top_k", "an integer >= 1, or 0 / -1 to disable", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        if not 0.0 <= self.min_p <= 1.0:
            raise _err("min_p", "in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise _err(name, "in [-2, 2]", v)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise _err("repetition_penalty", "in (0, 10]", self.repetition_penalty)
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED):
            raise _err("seed", f"an integer in [0, {_MAX_SEED}]", self.seed)
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 0
                                            or (self.max_tokens == 0 and self.prompt_logprobs is None)):
            # 0 generates nothing: only a scoring request (prompt_logprobs) has a result
            raise _err("max_tokens", "an integer >= 1 (0 only with prompt_logprobs: scoring the prompt)",
                       self.max_tokens)
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise _err("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _err("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 0):  # (the engine caps it: max_logprobs)
                raise _err(name, "an integer >= 0", v)
        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, dict) or not all(is_int(t) and t >= 0 for t in bias):
                raise _err("logit_bias", "a mapping of token ids (integers >= 0) to biases", bias)
            if not all(is_num(v) and -100.0 <= v <= 100.0 for v in bias.values()):
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r}")
            self.logit_bias = {int(t): float(v) for t, v in bias.items()} or None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self.stop = list(self.stop)
        else:
            raise _err("stop", "a string or a list of strings", self.stop)
        if any(s == "" for s in self.stop):
            raise _err("stop", "non-empty strings", self.stop)
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in ids):
            raise _err("stop_token_ids", "a list of non-negative integers", self.stop_token_ids)
        self.stop_token_ids = list(ids)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(is_int(t) and t >= 0 for t in ids):
                raise _err("allowed_token_ids", "a non-empty list of token ids (integers >= 0)", ids)
            self.allowed_token_ids = sorted(set(ids))
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
                raise _err("bad_words", "a list of non-blank strings", words)
            self.bad_words = list(words) or None
        k = self.truncate_prompt_tokens
        if k is not None and (not is_int(k) or k == 0 or k < -1):
            raise _err("truncate_prompt_tokens", "an integer >= 1, or -1 (max_model_len)", k)
        from .structured import check_structured_output
        self.structured_output = check_structured_output(self.structured_output)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_previous_token(self) -> bool:
        """Whether sampling a token needs the one before it on the host (penalties count the
        tokens; a structured output's mask and a bad word's ban follow them): no decode look-ahead
        then."""
        return self.uses_penalties or self.structured_output is not None or self.bad_words is not None

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self, **changes) -> "SamplingParams":
        return replace(self, **changes)
