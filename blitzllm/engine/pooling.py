"""Pooling requests in the engine: the model's pooling tasks (an embedding model embeds; a
sequence classifier classifies, and with one label scores text pairs as a cross-encoder, as
vLLM's tasks), its pooling defaults (``--pooler-config`` over a sentence-transformers folder's
files over vLLM's decoder default, LAST + normalized), a pooling request's checks, which hidden
rows each step must hand back, and the vector (or a classifier's probabilities, its head on the
pooled row) once its prompt is done.

A pooling request is prefill only: its prompt runs in chunks like any other, never samples and
never drafts. Each step's forward sums the final hidden states (after the final norm, the
input of ``compute_logits``) of the rows the request needs, in float32 on the device
(``ModelRunner.forward``'s ``spans``); the sums add up here across chunks, and the request
finishes with its vector when its last prompt token has been computed. Under tensor parallelism
the final norm all-reduces, so rank 0's hidden rows are whole and rank 0 pools alone.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..pooling_params import PoolerConfig, PoolingParams, parse_pooler_config
from .intake import truncated
from .request import Request

log = logging.getLogger("blitzllm.engine")

DECODER_DEFAULT = PoolerConfig(pooling_type="LAST", normalize=True)
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}


def sentence_transformers_config(folder: Optional[Path]) -> tuple:
    """(PoolerConfig, None) from a sentence-transformers folder's ``modules.json`` and its Pooling
    module's ``config.json`` (the first mode set true, as vLLM reads it; normalized when a
    Normalize module follows); (an empty PoolerConfig, None) without those files; (what could be
    read, why not the rest) for unreadable files or a pooling mode we do not have."""
    if folder is None or not (folder / "modules.json").is_file():
        return PoolerConfig(), None
    try:
        modules = json.loads((folder / "modules.json").read_text())
        types = [str(m.get("type", "")) for m in modules]
        pool = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
        modes = json.loads((folder / pool["path"] / "config.json").read_text()) if pool is not None else {}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        return PoolerConfig(), f"the model's sentence-transformers files could not be read ({type(e).__name__}: {e})"
    normalize = any(t.endswith(".Normalize") for t in types)
    mode = next((k for k, v in modes.items() if k.startswith("pooling_mode_") and v is True), None)
    if mode is None:
        return PoolerConfig(normalize=normalize), None
    if mode not in _ST_MODES:
        return (PoolerConfig(normalize=normalize),
                f"the model's sentence-transformers pooling {mode!r} is not supported (LAST, MEAN, CLS are)")
    return PoolerConfig(pooling_type=_ST_MODES[mode], normalize=normalize), None


@dataclass
class PoolState:
    """A pooling request's settings and its running sum of hidden rows."""
    pooling_type: str
    normalize: bool
    dimensions: Optional[int]
    total: Optional[torch.Tensor] = None   # float32 [hidden] on the device
    task: str = "embed"
    activation: Optional[str] = None       # classify / score: "softmax", "sigmoid" or None (raw logits)

    @property
    def needs_every_position(self) -> bool:
        """MEAN reads every prompt position, CLS the first: a prefix-cache hit would skip them."""
        return self.pooling_type != "LAST"


class Pooling:
    """The engine's pooling defaults and the steps of its pooling requests."""

    def __init__(self, pooler_config, folder: Optional[Path], hf_config: dict, num_labels: int = 0,
                 architecture: str = ""):
        self.num_labels, self.architecture = num_labels, architecture
        # (vLLM scores pairs with a classifier only when it has one label: its sigmoid is the score)
        self.tasks = ("embed",) if not num_labels else ("classify", "score") if num_labels == 1 else ("classify",)
        self.activations = {"classify": classify_activation(hf_config, num_labels),
                            "score": score_activation(hf_config, num_labels)} if num_labels else {}
        explicit = parse_pooler_config(pooler_config) or PoolerConfig()
        model_cfg, self.error = sentence_transformers_config(folder)
        if explicit.pooling_type is not None:
            self.error = None   # (the flag names the type the files could not)
        if self.error is not None:
            log.warning("%s: embedding requests are refused unless --pooler-config names a pooling_type", self.error)
        self.config = explicit.over(model_cfg.over(DECODER_DEFAULT))
        # matryoshka (vLLM's test): the HF config declares it, or lists the dimensions it was trained for
        self.matryoshka_dims = hf_config.get("matryoshka_dimensions") or None
        self.matryoshka = bool(self.matryoshka_dims) or bool(hf_config.get("is_matryoshka", False))

    def request(self, request_id: str, ids: list, params: PoolingParams, *, vocab_size: int, max_model_len: int,
                arrival: int) -> Request:
        """A pooling request for the scheduler, or a ValueError saying what is wrong."""
        if not isinstance(params, PoolingParams):
            raise ValueError("params must be a PoolingParams")
        task = params.task or "embed"
        if task not in self.tasks:
            raise ValueError(self.refusal(task))
        if task != "embed" and (params.dimensions is not None or params.normalize is not None):
            raise ValueError(f"dimensions and normalize are for embeddings, not the {task} task")
        if self.error is not None:
            raise ValueError(self.error)
        d = params.dimensions
        if d is not None and not self.matryoshka:
            raise ValueError("dimensions must be left unset: the model does not support matryoshka representation, "
                             "and other output dimensions would give poor embeddings")
        if d is not None and self.matryoshka_dims and d not in self.matryoshka_dims:
            raise ValueError(f"dimensions must be one of the model's matryoshka dimensions {self.matryoshka_dims}, "
                             f"got {d}")
        ids = truncated(ids, params.truncate_prompt_tokens, max_model_len)
        if not ids:
            raise ValueError("the prompt is empty")
        if any(t < 0 or t >= vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        if len(ids) > max_model_len:   # (nothing is generated: the prompt may fill the context)
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len={max_model_len}")
        state = PoolState(self.config.pooling_type,
                          self.config.normalize if params.normalize is None else params.normalize, d)
        if task != "embed":   # (the head reads the pooled row as it is)
            state.normalize, state.task = False, task
            state.activation = self.activations[task] if params.use_activation is not False else None
        req = Request(request_id=request_id, prompt_token_ids=list(ids), params=params, seed=0, arrival=arrival,
                      max_total_tokens=max_model_len)
        req.pooler = state
        return req

    def refusal(self, task: str) -> str:
        """Why this model does not run ``task`` ("generate" or a pooling task)."""
        if not self.num_labels:
            return (f"the {task} task needs a sequence classifier (a *ForSequenceClassification model); "
                    "this model generates and embeds")
        if task == "score":
            return (f"this {self.architecture} has {self.num_labels} labels: scoring text pairs needs a "
                    "classifier of one label (a cross-encoder); use classify")
        return (f"this model is a sequence classifier ({self.architecture}): it runs {' and '.join(self.tasks)}, "
                f"not {task}")


def classify_activation(hf_config: dict, num_labels: int) -> Optional[str]:
    """vLLM's classify activation, from transformers' ``problem_type``: none for a regression, a
    sigmoid per label for multi-label classification, else softmax (a sigmoid with one label)."""
    kind = hf_config.get("problem_type")
    if kind == "regression":
        return None
    if kind == "multi_label_classification" or num_labels < 2:
        return "sigmoid"
    return "softmax"


_ST_ACTIVATIONS = {"torch.nn.modules.linear.Identity": None, "torch.nn.modules.activation.Sigmoid": "sigmoid"}


def score_activation(hf_config: dict, num_labels: int) -> Optional[str]:
    """vLLM's cross-encoder activation: a sentence-transformers CrossEncoder's ``activation_fn``
    (Identity or Sigmoid here), else as classify's default (the sigmoid of the one label)."""
    st = hf_config.get("sentence_transformers")
    name = (st.get("activation_fn") if isinstance(st, dict) else None) \
        or hf_config.get("sbert_ce_default_activation_function")
    if name in _ST_ACTIVATIONS:
        return _ST_ACTIVATIONS[name]
    if name is not None:
        log.warning("cross-encoder activation %r is not supported (Identity, Sigmoid are): scores take the sigmoid",
                    name)
    return "sigmoid" if num_labels < 2 else "softmax"


def pool_spans(seqs) -> list:
    """(batch row, first, end) offsets within the row's chunk of the hidden rows each pooling
    request of the step needs summed."""
    out = []
    for i, s in enumerate(seqs):
        st = s.req.pooler
        if st is None:
            continue
        n = s.num_tokens
        if st.pooling_type == "MEAN":
            out.append((i, 0, n))
        elif st.pooling_type == "CLS" and s.start == 0:
            out.append((i, 0, 1))
        elif st.pooling_type == "LAST" and s.end == len(s.req.prompt_token_ids):
            out.append((i, n - 1, n))
    return out


def absorb(seqs, spans: list, sums: torch.Tensor) -> None:
    """Add a step's sums (``pool_spans`` order) to their requests' running totals; a chunk from
    position 0 starts a new total (a preempted request computes its prompt again)."""
    for (i, _, _), row in zip(spans, sums):
        s = seqs[i]
        st = s.req.pooler
        st.total = row if s.start == 0 or st.total is None else st.total + row


def vector(req: Request, head=None) -> list:
    """The finished request's embedding: the mean (MEAN) or the row, its first ``dimensions``
    values, L2-normalized where asked; for classify and score, ``head`` (pooled rows [N, hidden]
    -> logits [N, num_labels]) on it, through the task's activation."""
    st = req.pooler
    v = st.total / len(req.prompt_token_ids) if st.pooling_type == "MEAN" else st.total
    if st.task != "embed":
        logits = head(v[None])[0].float()
        if st.activation == "softmax":
            logits = logits.softmax(-1)
        elif st.activation == "sigmoid":
            logits = logits.sigmoid()
        return logits.cpu().tolist()
    if st.dimensions is not None:
        v = v[:st.dimensions]
    if st.normalize:
        v = torch.nn.functional.normalize(v, dim=-1)
    return v.cpu().tolist()


def cosine(a: list, b: list) -> float:
    """The cosine similarity of two vectors (0 where one is zero): vLLM's score of a text pair
    under an embedding model (``LLM.score``, the server's /v1/score and /v1/rerank)."""
    dot = sum(x * y for x, y in zip(a, b))
    norm = (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5
    return dot / norm if norm > 0 else 0.0


def pair_ids(tokenizer, a, b) -> list:
    """A cross-encoder's one sequence for a text pair: the tokenizer's pair encoding (its special
    tokens around and between the texts), as transformers' ``text_pair`` and vLLM's cross-encoder
    scoring make it."""
    if not isinstance(a, str) or not isinstance(b, str):
        raise ValueError("a cross-encoder scores text pairs: text_1 and text_2 must be texts, not token ids")
    if tokenizer is None:
        raise ValueError("scoring text pairs needs the model's tokenizer")
    return list(tokenizer(a, b, add_special_tokens=True).input_ids)


def score_pairs(text_1, text_2) -> tuple:
    """(left texts, right texts) of equal length: one ``text_1`` against every ``text_2``, or as
    many of each, pairwise (vLLM's rule); a ValueError otherwise."""
    def texts(x) -> list:   # (a text, token ids or a prompt dict is one)
        one = isinstance(x, (str, dict)) or (isinstance(x, list) and bool(x) and isinstance(x[0], int))
        return [x] if one else list(x)
    left, right = texts(text_1), texts(text_2)
    if not left or not right:
        raise ValueError("text_1 and text_2 must each hold at least one text")
    if len(left) == 1:
        left = left * len(right)
    elif len(left) != len(right):
        raise ValueError(f"text_1 holds {len(left)} texts and text_2 {len(right)}: give one text_1, or as many as "
                         "there are in text_2")
    return left, right
