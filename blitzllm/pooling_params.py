"""Pooling settings with vLLM's names: ``PoolingParams`` per request (an embedding, a
classification, a cross-encoder score), validated at construction, and ``PoolerConfig``, the
engine's defaults (``--pooler-config``). How a request's vector is made lives in
``engine/pooling.py``; the checks that need the model (its tasks, matryoshka ``dimensions``) are
there too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Optional, Union

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# vLLM's pooling tasks: an embedding model embeds; a sequence classifier classifies, and scores a
# text pair (one sequence, a cross-encoder) when it has one label
POOLING_TASKS = ("embed", "classify", "score")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class PoolingParams:
    # matryoshka: keep the first ``dimensions`` values of the pooled vector (before normalizing);
    # only for a model that declares matryoshka support
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None   # L2-normalize the vector; None: the engine's pooler config (true by default)
    truncate_prompt_tokens: Optional[int] = None  # keep the prompt's last k tokens (-1: max_model_len)
    task: Optional[str] = None   # one of POOLING_TASKS; None: "embed"
    # classify / score: the head's logits through the model's activation (softmax, sigmoid), or raw
    use_activation: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation must be true or false, got {self.use_activation!r}")
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {k!r}")


@dataclass(frozen=True)
class PoolerConfig:
    """How the engine pools when a request does not say: the vector of the last prompt token
    (``LAST``), the mean over the prompt (``MEAN``) or the first token's (``CLS``), L2-normalized
    or not. A field left None takes the model's (its sentence-transformers files), else
    ``LAST`` and normalized (vLLM's defaults for a decoder)."""
    pooling_type: Optional[str] = None
    normalize: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling_type!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config normalize must be true or false, got {self.normalize!r}")

    def over(self, base: "PoolerConfig") -> "PoolerConfig":
        """This config's fields where set, ``base``'s elsewhere."""
        return PoolerConfig(pooling_type=self.pooling_type or base.pooling_type,
                            normalize=base.normalize if self.normalize is None else self.normalize)


def json_object(value: Union[str, dict], name: str) -> dict:
    """An engine option given as JSON text or a dict (``--pooler-config``, ``--mm-processor-kwargs``, ...)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


def parse_pooler_config(value: Union[None, str, dict, PoolerConfig]) -> Optional[PoolerConfig]:
    """``--pooler-config`` / ``LLM(pooler_config=...)``: JSON text or a dict of PoolerConfig's
    keys (``pooling_type`` upper- or lower-case); None when not given."""
    if value is None or isinstance(value, PoolerConfig):
        return value
    value = json_object(value, "pooler_config")
    known = {f.name for f in fields(PoolerConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"pooler_config takes the keys {', '.join(sorted(known))}; unknown: {', '.join(map(str, unknown))}")
    kind = value.get("pooling_type")
    return PoolerConfig(pooling_type=kind.upper() if isinstance(kind, str) else kind, normalize=value.get("normalize"))
