"""vLLM's ``use_beam_search`` on /v1/completions and /v1/chat/completions: ``n`` beams wide (with
``length_penalty``), run through the async engine one token step at a time by the engine's beam
search (engine/beam_search.py). The answer comes whole; a stream, and the fields a beam step
cannot honour (stop strings, token constraints, penalties, structured outputs), are 400s naming
the field rather than silently ignored."""
from __future__ import annotations

from typing import Optional

from fastapi import Request

from ..engine.beam_search import MAX_BEAM_WIDTH, BeamSearch, BeamSearchParams, check_beam_width
from ..sampling_params import SamplingParams
from .errors import bad_request
from .serving import Serving, pick

# request fields that would change what a beam step computes (set to anything but their default)
_REFUSED = ("stream", "stop", "stop_token_ids", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words",
            "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
            "prompt_logprobs", "presence_penalty", "frequency_penalty", "kv_transfer_params")


def beam_params(req, params: SamplingParams, room: int) -> BeamSearchParams:
    """The beam search a request asks for; ``room``: the tokens its prompt leaves (for a request
    without max_tokens)."""
    for name in _REFUSED:
        if getattr(req, name, None):
            raise bad_request(f"{name} does not go with use_beam_search", param=name)
    if params.repetition_penalty != 1.0:
        raise bad_request("repetition_penalty does not go with use_beam_search", param="repetition_penalty")
    if params.n > MAX_BEAM_WIDTH:
        raise bad_request(f"n is the beam width with use_beam_search: at most {MAX_BEAM_WIDTH}, got {params.n}",
                          param="n")
    if getattr(req, "echo", False) and getattr(req, "logprobs", None) is not None:
        raise bad_request("echo with logprobs (the prompt's) does not go with use_beam_search", param="echo")
    try:
        return BeamSearchParams(beam_width=params.n, max_tokens=room if params.max_tokens is None else params.max_tokens,
                                ignore_eos=params.ignore_eos, temperature=params.temperature,
                                length_penalty=pick(req.length_penalty, 1.0),
                                include_stop_str_in_output=params.include_stop_str_in_output)
    except ValueError as e:   # (its message starts with the field's name)
        raise bad_request(str(e), param=str(e).split(" ", 1)[0]) from None


async def beam_answers(s: Serving, raw: Request, rid: str, prompts: list, bp: BeamSearchParams, prompt_field: str,
                       max_tokens_field: str, priority: Optional[int], lora_request=None,
                       cache_salt: Optional[str] = None) -> Optional[list]:
    """Per prompt (token ids) its ``bp.beam_width`` best beams (``BeamSearchSequence``s with their
    text), best first, under ``lora_request``'s adapter (None: the base model) and the prefix
    cache's ``cache_salt``; None if the client went away."""
    try:
        check_beam_width(bp.beam_width, s.max_logprobs)
    except ValueError as e:
        raise bad_request(f"n is the beam width with use_beam_search: {e} (--max-logprobs)", param="n") from None
    try:
        searches = [BeamSearch(ids, bp, s.aengine.engine.eos_token_ids, s.max_model_len) for ids in prompts]
    except ValueError as e:
        raise bad_request(str(e), param=prompt_field, code="context_length_exceeded") from None
    step, streams, n_steps = searches[0].step_params(), [], 0

    async def run() -> bool:
        nonlocal n_steps
        while live := [b for search in searches for b in search.live()]:
            streams.clear()
            for i, b in enumerate(live):
                streams.append(await s.submit(f"{rid}-beam{n_steps}-{i}", b.tokens, step, prompt_field,
                                              max_tokens_field, priority=priority, lora_request=lora_request,
                                              cache_salt=cache_salt))
            result = await s.collect(streams, 1)
            n_steps += 1
            for search in searches:
                k = len(search.beams)
                search.advance([c["lps"][0] for c in result[:k]])
                result = result[k:]
        return True

    if await s.until_done_or_gone(raw, run(), streams) is None:
        return None

    def decode(ids: list) -> str:
        return s.worker_tokenizer("").decode(ids, skip_special_tokens=True) if s.tokenizer is not None else ""

    return [await s.cpu(search.best, decode) for search in searches]
