"""POST /classify (vLLM's route): input(s) as text or token ids -> one engine pooling request
(task "classify") per input on a sequence classifier -> per input its class probabilities and
the most likely label (the config's ``id2label``). The request body and the response models
(the OpenAPI schema's, as ``protocol.py``'s) live here too."""
from __future__ import annotations

import time
from typing import Literal, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from ..pooling_params import PoolingParams
from .embeddings import base_model_only, embed_inputs
from .protocol import PoolingFields, PoolingInputs, _Out
from .serving import Serving, request_id


class ClassificationRequest(PoolingFields):
    """vLLM's /classify request (its completion form)."""
    input: PoolingInputs
    add_special_tokens: Optional[bool] = Field(True, description="the tokenizer's special tokens around a text "
                                                                 "input (a BOS)")
    use_activation: Optional[bool] = Field(None, description="false: the head's raw logits instead of "
                                                             "probabilities (null: true)")


class ClassificationData(_Out):
    index: int
    label: Optional[str] = Field(description="the most likely class's name (id2label)")
    probs: list[float] = Field(description="per class: the softmax over the classes (a sigmoid with one class)")
    num_classes: int


class ClassificationUsage(_Out):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: Literal[0]
    prompt_tokens_details: None


class ClassificationResponse(_Out):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ClassificationData]
    usage: ClassificationUsage


async def create_classify(s: Serving, req: ClassificationRequest, raw: Request) -> Response:
    base_model_only(s, req.model, "classification")
    try:
        params = PoolingParams(task="classify", truncate_prompt_tokens=s.truncation(req),
                               use_activation=req.use_activation)
    except ValueError as e:
        raise s._user_error(e, "input") from None
    base = f"classify-{request_id(raw)}"
    got = await embed_inputs(s, raw, base, req.input, params, req.add_special_tokens is not False,
                             priority=req.priority)
    if got is None:
        return Response(status_code=499)
    rows, n = got
    data = []
    for i, probs in enumerate(rows):
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": s.labels[best] if best < len(s.labels) else None, "probs": probs,
                     "num_classes": len(probs)})
    return JSONResponse({"id": base, "object": "list", "created": int(time.time()), "model": s.model_name,
                         "data": data, "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
                                                 "prompt_tokens_details": None}})
