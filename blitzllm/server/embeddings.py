"""POST /v1/embeddings: input(s) as text or token ids, or (vLLM's chat form) ``messages`` rendered
by the model's chat template as chat renders them -> one engine pooling request per input
(engine/pooling.py) -> OpenAI's list of embeddings, as floats or base64 (little-endian float32
bytes, which OpenAI's SDK decodes)."""
from __future__ import annotations

import asyncio
import base64
import struct
import time
from typing import Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.intake import truncated
from ..pooling_params import PoolingParams
from .chat_template import prompt_end
from .errors import bad_request
from .protocol import EmbeddingChatRequest, EmbeddingRequest
from .completions import prompt_list
from .serving import Serving, pick, request_id


def _inputs(s: Serving, inp, name: str = "input") -> list:
    """[(text or token ids, param)], in a worker thread: a text past the character bound and token
    ids outside the vocabulary are refused before anything is tokenized."""
    out = []
    for p, field in prompt_list(inp, name):
        if isinstance(p, str):
            s.need_tokenizer("pass the input as token ids")
            s.check_prompt_chars(p, field)
        elif any(t < 0 or t >= s.vocab_size for t in p):
            raise bad_request(f"input token ids must be in [0, {s.vocab_size})", param=field)
        out.append((p, field))
    return out


async def _ids(s: Serving, p, field: str, params: PoolingParams, add_special_tokens: bool) -> list:
    """The ids the engine will pool: a text's tokens, truncated as asked; refused past
    max_model_len (nothing is generated, so a prompt may fill the context)."""
    ids = await s.tokens(p, add_special_tokens) if isinstance(p, str) else list(p)
    ids = truncated(ids, params.truncate_prompt_tokens, s.max_model_len)
    if len(ids) > s.max_model_len:
        raise bad_request(f"the input has {len(ids)} tokens, more than max_model_len={s.max_model_len}",
                          param=field, code="context_length_exceeded")
    return ids


def _encoded(v: list, fmt: str):
    return v if fmt == "float" else base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii")


def base_model_only(s: Serving, model, what: str = "embeddings") -> None:
    if s.check_model(model) is not None:
        raise bad_request(f"{what} run on the base model ('{s.model_name}'), not a LoRA adapter", param="model")


async def embed_inputs(s: Serving, raw: Request, base: str, inp, params: PoolingParams, add_special: bool,
                       field: str = "input", priority: Optional[int] = 0):
    """``inp`` (an embeddings request's ``input`` form) pooled as ``params`` say: (the vectors, or
    a classifier's probabilities, in order; their tokens counted), or None when the client went
    away."""
    inputs = await s.cpu(_inputs, s, inp, field)
    prompts = await asyncio.gather(*(_ids(s, p, f, params, add_special) for p, f in inputs))
    # (added together: the engine takes a batch of adds between two steps)
    added = await asyncio.gather(*(s.submit(f"{base}-{j}", ids, params, field, priority=priority)
                                   for j, ids in enumerate(prompts)), return_exceptions=True)
    streams = [a for a in added if not isinstance(a, BaseException)]
    failed = [a for a in added if isinstance(a, BaseException)]
    if failed:
        s.abort(streams)
        raise failed[0]
    result = await s.until_done_or_gone(raw, s.collect(streams, 1), streams)
    return None if result is None else ([c["embedding"] for c in result], sum(map(len, prompts)))


def embedding_model(body: dict) -> type:
    """The model a body parses into: ``input`` (OpenAI's form) or ``messages`` (vLLM's chat form),
    exactly one of them (null counts as absent)."""
    has_input, has_messages = body.get("input") is not None, body.get("messages") is not None
    if has_input and has_messages:
        raise bad_request("give 'input' or 'messages', not both", param="messages")
    if not (has_input or has_messages):
        raise bad_request("give 'input' (texts or token ids) or 'messages' (a chat to embed)", param="input",
                          code="missing_field")
    return EmbeddingChatRequest if has_messages else EmbeddingRequest


async def _chat_ids(s: Serving, req: EmbeddingChatRequest) -> list:
    """The messages' token ids through the model's chat template (chat's rendering and checks of
    the messages), ending as the request's add_generation_prompt / continue_final_message say."""
    end = prompt_end(pick(req.add_generation_prompt, False), req.continue_final_message)
    # (the length is checked once truncated, by embed_inputs: an embedding may fill the context)
    ids, _ = await s.chat_prompt(req.messages, end, req.chat_template_kwargs, check_length=False,
                                 add_special_tokens=bool(req.add_special_tokens), template=req.chat_template)
    return ids


async def create_embedding(s: Serving, req: Union[EmbeddingRequest, EmbeddingChatRequest], raw: Request) -> Response:
    base_model_only(s, req.model)
    chat = isinstance(req, EmbeddingChatRequest)
    field = "messages" if chat else "input"
    try:
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize,
                               truncate_prompt_tokens=s.truncation(req))
    except ValueError as e:
        raise s._user_error(e, field) from None
    base = f"embd-{request_id(raw)}"
    # (the chat form is one input, its token ids: the template wrote its special tokens)
    inp = await _chat_ids(s, req) if chat else req.input
    got = await embed_inputs(s, raw, base, inp, params, not chat and req.add_special_tokens is not False, field,
                             req.priority)
    if got is None:
        return Response(status_code=499)
    vectors, n = got
    data = [{"object": "embedding", "embedding": _encoded(v, req.encoding_format), "index": i}
            for i, v in enumerate(vectors)]
    return JSONResponse({"id": base, "object": "list", "created": int(time.time()), "model": s.model_name,
                         "data": data, "usage": {"prompt_tokens": n, "total_tokens": n}})
