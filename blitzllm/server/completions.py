"""POST /v1/completions: prompt(s) as text or token ids, or vLLM's prompt_embeds -> one engine
request per prompt (n sequences each) -> a text_completion body or SSE stream; choice index =
prompt * n + i."""
from __future__ import annotations

import base64
import binascii
import io
import pickle
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.async_engine import EngineStepError
from ..sampling_params import SamplingParams
from .beam import beam_answers, beam_params
from .chat import as_token_ids, check_prompt_logprobs, prompt_logprobs_body, token_str
from .errors import bad_request
from .protocol import CompletionRequest
from .serving import SSE_DONE, Serving, SSEResponse, kv_field, lp_value, merge, pick, request_id, sse, usage


def prompt_list(prompt, field: str) -> list:
    """[(prompt, its param)] of ``str | list[str] | list[int] | list[list[int]]`` (completions'
    ``prompt``, embeddings' ``input``); an empty list is a 400."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif not prompt:
        raise bad_request(f"{field} must not be empty", param=field)
    elif isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    return [(p, field if len(prompts) == 1 else f"{field}.{j}") for j, p in enumerate(prompts)]


def _completion_prompts(s: Serving, prompt, echo: bool, params: SamplingParams) -> list:
    """[(ids or text, param, echo text)] for str | list[str] | list[int] | list[list[int]], in a
    worker thread: a text past the character bound, and token ids that leave no room to
    generate (once truncated as ``params`` ask), are refused here; texts are tokenized next
    (``_tokenized``)."""
    out = []
    for p, field in prompt_list(prompt, "prompt"):
        if isinstance(p, str):
            s.need_tokenizer("pass the prompt as token ids")
            s.check_prompt_chars(p, field)
            out.append((p, field, p))
        else:
            if not p:
                raise bad_request("prompt must not be empty", param="prompt")
            p = s.truncated(p, params, field)
            if any(t < 0 or t >= s.vocab_size for t in p):
                raise bad_request(f"prompt token ids must be in [0, {s.vocab_size})", param="prompt")
            text = None
            if echo:
                text = s.worker_tokenizer("").decode(p) if s.tokenizer is not None else ""
            out.append((list(p), field, text))
    return out


def _embeds_prompts(s: Serving, req: CompletionRequest, params: SamplingParams) -> list:
    """[(placeholder ids, tensor [P, hidden])] of vLLM's ``prompt_embeds`` (base64 of
    ``torch.save``'d tensors, read with ``weights_only``), truncated as ``params`` ask, in a worker
    thread; the engine checks the rest (``enable_prompt_embeds``, the hidden size, the length)."""
    import torch
    if req.prompt is not None:
        raise bad_request("give prompt or prompt_embeds, not both", param="prompt_embeds")
    if req.echo or req.use_beam_search:
        raise bad_request("prompt_embeds have no prompt text to echo or beam-search from",
                          param="echo" if req.echo else "use_beam_search")
    items = [req.prompt_embeds] if isinstance(req.prompt_embeds, str) else req.prompt_embeds
    out = []
    for j, b64 in enumerate(items):
        field = "prompt_embeds" if len(items) == 1 else f"prompt_embeds.{j}"
        try:
            t = torch.load(io.BytesIO(base64.b64decode(b64, validate=True)), weights_only=True, map_location="cpu")
        except (binascii.Error, ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
            raise bad_request(f"{field} must be a base64-encoded torch.save of a tensor ({type(e).__name__})",
                              param=field) from None
        if not isinstance(t, torch.Tensor) or t.dim() not in (2, 3) or (t.dim() == 3 and t.shape[0] != 1):
            raise bad_request(f"{field} must hold a [num_tokens, hidden_size] tensor", param=field)
        t = t.reshape(t.shape[-2], t.shape[-1])
        if t.shape[0] == 0:
            raise bad_request(f"{field} must not be empty", param=field)
        keep = s.truncated(list(range(t.shape[0])), params, field)
        out.append(([0] * len(keep), t[t.shape[0] - len(keep):]))
    return out


async def _tokenized(s: Serving, p, field: str, text, params: SamplingParams, echo: bool) -> tuple:
    """(ids, text) of a prompt: a text's ids, truncated as ``params`` ask (with ``echo``, its text
    becomes the part the model saw), or token ids as they came."""
    if not isinstance(p, str):
        return p, text
    if params.truncate_prompt_tokens is None:
        return await s.tokens(p, True, field), text
    ids = await s.tokens(p, True)
    kept = s.truncated(ids, params, field)
    if echo and len(kept) < len(ids):
        text = await s.cpu(lambda: s.worker_tokenizer("").decode(kept))
    return kept, text


def _legacy_logprobs(s: Serving, token_ids, lps, k, offset: int = 0, as_ids: bool = False) -> dict:
    """The legacy completions logprobs: parallel lists, top-k as {token text: logprob} plus the
    chosen token where it is not among them (k + 1 entries, as OpenAI's legacy API and vLLM give
    it). A token whose entry in ``lps`` is None (an echoed prompt's first) has null ones.
    ``as_ids``: tokens as ``token_id:<id>`` (the text offsets stay the text's)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, d in zip(token_ids, lps):
        tokens.append(token_str(s, tid, as_ids))
        offsets.append(offset)
        offset += len(s.tok_str(tid))
        if d is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(lp_value(d.get(tid, -9999.0)))
        top = sorted(d.items(), key=lambda kv: -kv[1])[:k]
        if tid not in dict(top):
            top.append((tid, d.get(tid, -9999.0)))
        tops.append({token_str(s, t, as_ids): lp_value(v) for t, v in top})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _prompt_logprobs(s: Serving, ids, plp, k, as_ids: bool = False) -> dict:
    """The echoed prompt's part of the legacy logprobs (its first token has none)."""
    return _legacy_logprobs(s, ids, plp or [None] * len(ids), k, 0, as_ids)


async def create_completion(s: Serving, req: CompletionRequest, raw: Request) -> Response:
    lora = s.check_model(req.model)
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != pick(req.n, 1):
        raise bad_request("best_of is not supported (it must be null or equal n)", param="best_of")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be >= 1 (0 only with echo: scoring the prompt)", param="max_tokens")
    requested = s.structured_request(req)
    plp_k, as_ids = check_prompt_logprobs(req), as_token_ids(s, req)  # (vLLM's prompt_logprobs)
    scoring = req.logprobs if req.echo else None  # echo + logprobs: the prompt's logprobs too
    if req.max_tokens == 0 and scoring is None:
        scoring = 0  # echo alone with max_tokens 0: the engine takes it as a scoring request
    if plp_k is not None:  # (the engine's top-N serves both, each cut to its own)
        scoring = max(plp_k, scoring or 0)
    max_tokens = pick(req.max_tokens, min(16, s.defaults.get("max_tokens", 16)))  # (a generation config's cap)
    params = s.sampling_params(req, max_tokens, req.logprobs, structured=requested, prompt_logprobs=scoring)
    structured_field = requested[1]
    if req.prompt_embeds is not None:
        embedded = await s.cpu(_embeds_prompts, s, req, params)
        prompts, embeds = [(ids, "") for ids, _ in embedded], [t for _, t in embedded]
    elif req.prompt is None:
        raise bad_request("prompt is required (or vLLM's prompt_embeds)", param="prompt")
    else:
        prompts = [await _tokenized(s, p, field, text, params, bool(req.echo))
                   for p, field, text in await s.cpu(_completion_prompts, s, req.prompt, bool(req.echo), params)]
        embeds = [None] * len(prompts)
    if req.kv_transfer_params and len(prompts) > 1:
        raise bad_request("kv_transfer_params takes a single prompt", param="kv_transfer_params")
    base = f"cmpl-{request_id(raw)}"
    if req.use_beam_search:
        return await _beam_completion(s, req, raw, base, prompts, params, as_ids, lora)
    rids = [f"{base}-{j}" for j in range(len(prompts))]
    streams = []
    try:
        for rid, (ids, _), emb in zip(rids, prompts, embeds):
            streams.append(await s.submit(rid, ids if emb is None else None, params,
                                          "prompt" if emb is None else "prompt_embeds",
                                          structured_field=structured_field, kv_transfer_params=req.kv_transfer_params,
                                          priority=req.priority, lora_request=lora, cache_salt=req.cache_salt,
                                          prompt_embeds=emb))
    except BaseException:  # (only the ones submitted: an id in use may be another request's)
        s.abort(streams)
        raise
    created = int(time.time())
    n, k = params.n, req.logprobs
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    echoes = [text if req.echo else "" for _, text in prompts]
    if req.stream:
        opts = req.stream_options
        echo_ids = [ids for ids, _ in prompts] if req.echo and k is not None else None
        return SSEResponse(_cmpl_sse(s, base, created, streams, n, k, echoes, echo_ids, prompt_tokens,
                                     bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats),
                                     as_ids, s.answer_model(lora)),
                           on_close=lambda: s.abort(streams))
    result = await s.until_done_or_gone(raw, s.collect(streams, n), streams)
    if result is None:
        return Response(status_code=499)
    choices = []
    for i, c in enumerate(result):
        echo, first = echoes[i // n], result[i - i % n]  # (the prompt's logprobs come with each prompt's first choice)
        lp = None
        if k is not None:
            lp = _legacy_logprobs(s, c["ids"], c["lps"], k, len(echo), as_ids)
            if req.echo:
                plp = _prompt_logprobs(s, prompts[i // n][0], first["plp"], k, as_ids)
                lp = {key: plp[key] + lp[key] for key in lp}
        choices.append({"index": i, "text": echo + "".join(c["text"]), "logprobs": lp,
                        "finish_reason": c["reason"], "stop_reason": c["stop"]})
        if plp_k is not None:   # (each choice of a prompt carries its prompt's, as vLLM's)
            choices[-1]["prompt_logprobs"] = prompt_logprobs_body(s, prompts[i // n][0], first["plp"], first["ranks"],
                                                                  plp_k, params.prompt_logprobs)
    ntok = sum(len(c["ids"]) for c in result)
    return JSONResponse({"id": base, "object": "text_completion", "created": created, "model": s.answer_model(lora),
                         "choices": choices, "usage": usage(prompt_tokens, ntok, s.cached(c["cached"] for c in result[::n])),
                         **kv_field(result)})


async def _beam_completion(s: Serving, req: CompletionRequest, raw: Request, base: str, prompts: list,
                           params: SamplingParams, as_ids: bool, lora) -> Response:
    """use_beam_search: choice j * n + i is prompt j's i-th best beam (``lora``: the adapter's)."""
    bp = beam_params(req, params, s.max_model_len - max(len(ids) for ids, _ in prompts))
    beams = await beam_answers(s, raw, base, [ids for ids, _ in prompts], bp, "prompt", "max_tokens", req.priority,
                               lora, req.cache_salt)
    if beams is None:
        return Response(status_code=499)
    choices, ntok = [], 0
    for j, ((ids, text), best) in enumerate(zip(prompts, beams)):
        echo = text if req.echo else ""
        for i, b in enumerate(best):
            gen = b.tokens[len(ids):]
            ntok += len(gen)
            lp = None if req.logprobs is None else _legacy_logprobs(s, gen, b.logprobs, req.logprobs, len(echo), as_ids)
            choices.append({"index": j * bp.beam_width + i, "text": echo + b.text, "logprobs": lp,
                            "finish_reason": b.finish_reason, "stop_reason": None})
    return JSONResponse({"id": base, "object": "text_completion", "created": int(time.time()),
                         "model": s.answer_model(lora), "choices": choices,
                         "usage": usage(sum(len(ids) for ids, _ in prompts), ntok)})


async def _cmpl_sse(s: Serving, base, created, streams, n, k, echoes, echo_ids, prompt_tokens, include_usage,
                    continuous, as_ids, model: str):
    """With echo, each choice's first event is its prompt's text: at once, or, with ``echo_ids``
    (echo + logprobs: each prompt's ids), with its prompt logprobs once the prefill has computed
    them (the first event of the prompt's first choice carries them; the engine schedules that
    choice first)."""
    head = {"id": base, "object": "text_completion", "created": created, "model": model}
    ntok = 0
    cached: dict = {}   # prompt -> the tokens the prefix cache served it
    offsets = {}
    echo_lp = echo_ids is not None
    plps: dict = {}     # prompt -> its prompt logprobs
    pending = set()     # choices whose echo is still to come
    try:
        for j, echo in enumerate(echoes):
            for i in range(n):
                offsets[j * n + i] = len(echo)
                if echo_lp:
                    pending.add(j * n + i)
                elif echo:
                    yield sse({**head, "choices": [{"index": j * n + i, "text": echo, "logprobs": None,
                                                    "finish_reason": None}]})
        async for j, ev in merge(streams):
            idx = j * n + ev.index
            if ev.prompt_logprobs is not None:
                plps[j] = ev.prompt_logprobs
            if idx in pending:
                pending.discard(idx)
                yield sse({**head, "choices": [{"index": idx, "text": echoes[j], "finish_reason": None,
                                                "logprobs": _prompt_logprobs(s, echo_ids[j], plps.get(j), k,
                                                                             as_ids)}]})
            ntok += len(ev.new_token_ids)
            if ev.index == 0 and ev.num_cached_tokens is not None:
                cached[j] = ev.num_cached_tokens
            # skip empty deltas (text held back for stop strings or partial UTF-8); a model
            # without a tokenizer streams one empty chunk per token so clients see progress
            if not ev.text and ev.finish_reason is None and k is None and s.tokenizer is not None:
                continue
            lp = None
            if k is not None:
                lp = _legacy_logprobs(s, ev.new_token_ids, ev.logprobs or [], k, offsets[idx], as_ids)
            offsets[idx] += len(ev.text)
            choice = {"index": idx, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish_reason}
            if ev.finish_reason is not None:
                choice["stop_reason"] = ev.stop_reason
            chunk = {**head, "choices": [choice]}
            if continuous and include_usage:
                chunk["usage"] = usage(prompt_tokens, ntok, s.cached(cached.values()))
            yield sse(chunk)
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(prompt_tokens, ntok, s.cached(cached.values()))})
    except EngineStepError as e:
        yield s.stream_error(e)
    yield SSE_DONE
