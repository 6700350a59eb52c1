"""Beam search as vLLM builds it (``LLM.beam_search``, the server's ``use_beam_search``): on top of
one-token requests, so it needs nothing of the scheduler or the runner. Each step every live beam
asks the engine for one token with its top 2 * beam_width logprobs; each of those tokens extends
the beam (its logprob added to the beam's sum); an extension that ends in EOS is set aside as
complete, the beam_width best others by the length-penalized score go on. After max_tokens steps
the beam_width best of the completed and the live beams are the answer. The prefix cache keeps a
step's recompute to each beam's last partial block.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..sampling_params import SamplingParams

# the candidates of a beam come from its step's top 2 * beam_width logprobs, at most 20 (the engine's
# default max_logprobs; a lower one narrows the beams: check_beam_width)
MAX_BEAM_WIDTH = 10
MAX_LENGTH_PENALTY = 10.0


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    # the step requests' (the candidates are ranked by the model's own logprobs, which it leaves as
    # they are: vLLM's too)
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False   # the EOS token's text at the end of a beam that ends in it

    def __post_init__(self) -> None:
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)
        if not is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("temperature", "length_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v or abs(v) == float("inf"):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if abs(self.length_penalty) > MAX_LENGTH_PENALTY:   # (a length to its power stays a float)
            raise ValueError(f"length_penalty must be in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}], "
                             f"got {self.length_penalty!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")


def check_beam_width(beam_width: int, max_logprobs: int) -> None:
    if 2 * beam_width > max_logprobs:
        raise ValueError(f"beam_width {beam_width} ranks 2 * {beam_width} candidates a step, more than the "
                         f"engine's max_logprobs ({max_logprobs})")


@dataclass
class BeamSearchSequence:
    tokens: list                  # the prompt's and the generated ones (vLLM's)
    logprobs: list = field(default_factory=list)   # per generated token: {token id: logprob} of its step
    cum_logprob: float = 0.0      # the generated tokens' logprobs summed
    text: Optional[str] = None    # the generated tokens' text
    finish_reason: Optional[str] = None   # stop (EOS) | length
    stop_reason: Optional[int] = None     # the EOS token id that ended it


@dataclass
class BeamSearchOutput:
    sequences: list               # the best beams, best first


def beam_score(tokens: list, cum_logprob: float, eos_ids: tuple, length_penalty: float) -> float:
    """vLLM's ranking: the summed logprob over the sequence's length (prompt included, a final EOS
    not) to the power ``length_penalty``."""
    n = len(tokens) - (1 if tokens[-1] in eos_ids else 0)
    return cum_logprob / n ** length_penalty


class BeamSearch:
    """One prompt's search: ``live()`` beams ask for a step, ``advance`` takes each one's
    {token id: logprob}, until ``live()`` is empty; then ``best()``."""

    def __init__(self, prompt_ids: list, params: BeamSearchParams, eos_ids: tuple, max_model_len: int):
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, which leaves no room to generate within "
                             f"max_model_len={max_model_len}")
        self.params, self.eos_ids, self.max_model_len = params, tuple(eos_ids), max_model_len
        self.prompt_len = len(prompt_ids)
        self.beams = [BeamSearchSequence(list(prompt_ids))]
        self.completed: list = []
        self.steps = 0

    def step_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=1, logprobs=2 * self.params.beam_width, temperature=self.params.temperature,
                              ignore_eos=True)

    def live(self) -> list:
        """The beams to extend this step (a beam at the context length is complete: 'length')."""
        full = [b for b in self.beams if len(b.tokens) >= self.max_model_len]
        for b in full:
            b.finish_reason = "length"
        self.completed += full
        self.beams = [b for b in self.beams if len(b.tokens) < self.max_model_len]
        return self.beams

    def score(self, b: BeamSearchSequence) -> float:
        return beam_score(b.tokens, b.cum_logprob, self.eos_ids, self.params.length_penalty)

    def advance(self, step_logprobs: list) -> None:
        """``step_logprobs``: per live beam, its step's {token id: logprob} (the top 2 * beam_width
        and the drawn token)."""
        w = self.params.beam_width
        cands = []
        for beam, lps in zip(self.beams, step_logprobs, strict=True):
            for tok, lp in sorted(lps.items(), key=lambda kv: -kv[1])[:2 * w]:
                new = BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [lps], beam.cum_logprob + lp)
                if tok in self.eos_ids and not self.params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", tok
                    self.completed.append(new)
                else:
                    cands.append(new)
        cands.sort(key=self.score, reverse=True)
        self.beams = cands[:w]
        self.steps += 1
        if self.steps >= self.params.max_tokens:
            for b in self.beams:
                b.finish_reason = "length"
            self.completed += self.beams
            self.beams = []

    def best(self, decode) -> list:
        """The beam_width best finished beams, best first, each with its text (``decode``: token
        ids -> text; a final EOS left out unless include_stop_str_in_output)."""
        out = sorted(self.completed, key=self.score, reverse=True)[:self.params.beam_width]
        for b in out:
            gen = b.tokens[self.prompt_len:]
            if b.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                gen = gen[:-1]
            b.text = decode(gen)
        return out
