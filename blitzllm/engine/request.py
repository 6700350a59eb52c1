"""A request (one sequence) as the engine tracks it, and the outputs handed back."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a request is its identity: list membership must not compare every field
class Request:
    request_id: str
    prompt_token_ids: list
    params: SamplingParams        # (a PoolingParams for an embedding request)
    seed: int
    arrival: int                  # arrival order
    priority: int = 0             # the priority policy's: lower first (engine/scheduler.py)
    eos_token_ids: tuple = ()
    max_total_tokens: int = 0     # prompt + output cap (context length)
    prompt: Optional[str] = None
    output_token_ids: list = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)   # per token {id: logprob} or None
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: Optional[str] = None
    stop_reason: object = None
    detok: object = None
    num_cached_tokens: int = 0
    matcher: object = None        # structured output: its grammar matcher (blitzllm/structured.py)
    bad_words: tuple = ()         # params.bad_words as token id tuples (engine/intake.py)
    # with params.prompt_logprobs (the first of n sequences): per prompt token from the second on,
    # {id: logprob} of it and the top-N, filled by the prefill; None otherwise
    prompt_logprobs: Optional[list] = None
    # beside them: per prompt token from the second on, its rank in the whole vocabulary (the
    # number of entries whose logprob is >= its own, so 1 for the most likely, as vLLM counts it)
    prompt_ranks: Optional[list] = None
    # disaggregation (blitzllm/kv_transfer): the request's kv_transfer_params (on a producer, the
    # consumer's params once it finished), and the KV pulled for it until it lands in its blocks
    kv_transfer_params: Optional[dict] = None
    kv_payload: object = None
    lora: object = None           # its LoRA adapter (blitzllm/lora LoRAAdapter), None for the base model
    pooler: object = None   # an embedding request's pooling state (engine/pooling.py); None for generation
    # the prompt's images (engine/images.py PromptImages) or its embeddings (engine/prompt_embeds.py
    # PromptEmbeds: its token ids are placeholders); None for text
    images: object = None
    cache_salt: Optional[str] = None   # vLLM's: KV is shared only between requests of the same salt

    @property
    def cache_root(self):
        """What its prefix-cache hashes start from: KV is shared only under the same adapter and
        cache salt."""
        lora = None if self.lora is None else self.lora.key
        return lora if self.cache_salt is None else ("salt", self.cache_salt, lora)

    @property
    def cacheable_tokens(self) -> list:
        """The tokens the prefix cache may serve: none when pooling reads every prompt position
        (MEAN, CLS); for prompt logprobs, those before the first position whose logits they still
        need; else all."""
        if self.pooler is not None and self.pooler.needs_every_position:
            return []
        first = self.prompt_logprobs_from
        return self.hash_tokens if first is None else self.hash_tokens[:first + 1]

    @property
    def known_prompt_ids(self) -> Optional[list]:
        """The prompt's token ids; None for a prompt given as embeddings (placeholder ids)."""
        return self.prompt_token_ids if self.images is None or self.images.text_ids else None

    @property
    def hash_tokens(self) -> list:
        """The tokens as the prefix cache hashes them: an image's placeholder tokens stand as
        (image key, index), so only the same image shares their KV."""
        if self.images is None:
            return self.all_token_ids
        return self.images.hash_prompt + self.output_token_ids

    @property
    def prompt_logprobs_from(self) -> Optional[int]:
        """The first prompt position whose logits the prompt logprobs still need (position p
        scores token p + 1); None when there are none to compute."""
        if self.prompt_logprobs is None or len(self.prompt_logprobs) >= len(self.prompt_token_ids) - 1:
            return None
        return len(self.prompt_logprobs)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    logprobs: Optional[list]
    finish_reason: Optional[str]
    stop_reason: object = None
    cumulative_logprob: Optional[float] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    outputs: list
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list] = None   # None, then per later prompt token {id: logprob}

    # convenience accessors for the first (usually only) completion
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list:
        return self.outputs[0].token_ids

    @property
    def logprobs(self):
        return self.outputs[0].logprobs

    @property
    def finish_reason(self):
        return self.outputs[0].finish_reason


@dataclass
class EmbeddingOutput:
    embedding: list   # floats

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed``'s answer per prompt (vLLM's shape)."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list
    finished: bool


@dataclass
class ClassificationOutput:
    probs: list   # per label: softmax over the labels (a sigmoid with one), or the raw logits

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """``LLM.classify``'s answer per prompt (vLLM's shape)."""
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list
    finished: bool


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """``LLM.score``'s answer per pair (vLLM's shape)."""
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list   # (the two texts' tokens one after the other; a cross-encoder's: the pair's)
    finished: bool


@torch.inference_mode()
def score_prompt(req: Request, logits: torch.Tensor, lo: int) -> None:
    """Rows of ``logits`` score prompt positions lo, lo + 1, ...: each gives the logprob of the
    next prompt token and the top-N (raw log-softmax, as a generated token's) into
    ``req.prompt_logprobs``, and that token's rank into ``req.prompt_ranks``."""
    k = req.params.prompt_logprobs
    targets = req.prompt_token_ids[lo + 1:lo + 1 + logits.shape[0]]
    for a in range(0, len(targets), 256):  # (a few rows at a time: [rows, V] float32)
        lp = logits[a:a + 256].float().log_softmax(-1)
        t = torch.tensor(targets[a:a + 256], device=lp.device)
        chosen = lp.gather(1, t[:, None])
        ranks = (lp >= chosen).sum(-1).tolist()   # (on the device, in the same pass)
        chosen = chosen[:, 0].tolist()
        top = lp.topk(k, dim=-1) if k else None
        top_ids = top.indices.tolist() if k else [[]] * len(chosen)
        top_lps = top.values.tolist() if k else [[]] * len(chosen)
        for tid, c, ids, vals in zip(targets[a:a + 256], chosen, top_ids, top_lps):
            d = {tid: c}
            for j, v in zip(ids, vals):
                d.setdefault(j, v)
            req.prompt_logprobs.append(d)
        req.prompt_ranks.extend(ranks)


def gathered() -> dict:
    """One completion as a caller gathers it from its StepEvents (``gather``): text pieces, token
    ids, logprobs, finish and stop reason, prompt logprobs and their tokens' ranks, KV transfer params,
    cached tokens, a pooling request's embedding."""
    return {"text": [], "ids": [], "lps": [], "reason": None, "stop": None, "plp": None, "ranks": None, "kv": None,
            "cached": 0, "embedding": None}


def gather(c: dict, ev) -> None:
    """Add a StepEvent (``engine.StepEvent``) of the completion to ``c`` (``gathered()``)."""
    c["text"].append(ev.text)
    c["ids"].extend(ev.new_token_ids)
    if ev.logprobs is not None:
        c["lps"].extend(ev.logprobs)
    if ev.prompt_logprobs is not None:
        c["plp"], c["ranks"] = ev.prompt_logprobs, ev.prompt_ranks
    if ev.kv_transfer_params is not None:
        c["kv"] = ev.kv_transfer_params
    if ev.num_cached_tokens is not None:
        c["cached"] = ev.num_cached_tokens
    if ev.embedding is not None:
        c["embedding"] = ev.embedding
    if ev.finish_reason is not None:
        c["reason"], c["stop"] = ev.finish_reason, ev.stop_reason
