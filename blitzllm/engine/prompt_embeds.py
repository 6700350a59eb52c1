"""Prompts given as input embeddings (vLLM's ``prompt_embeds``, with ``enable_prompt_embeds``):
a [P, hidden] tensor stands where a prompt's token embeddings would.

The request holds P placeholder token ids, so the scheduler, the KV cache and the sampler see an
ordinary prompt of P tokens; a ``PromptEmbeds`` beside them (the request's ``images`` slot: the
runner reads both the same way, ``runner/model_runner.py``'s ``image_step``) gives the runner the
rows to put in place of the placeholders' embeddings during the prefill, at the plain text
positions. The prefix cache hashes the tensor's bytes instead of the placeholders, the penalties
and the detokenizer see no prompt tokens, and the tensor is kept until the request ends (a
preempted request's prefill is recomputed from it).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

PLACEHOLDER = 0   # the token id of each embedded position (never embedded: its row is replaced)


@dataclass(eq=False)
class PromptEmbeds:
    tensor: torch.Tensor    # [P, hidden] on the host, in the model's dtype
    hash_prompt: list       # (digest, i) per position: the prompt the prefix cache hashes
    mrope = False           # its positions are a text prompt's (no M-RoPE rows)
    text_ids = False        # its prompt token ids are placeholders

    @classmethod
    def make(cls, tensor: torch.Tensor) -> "PromptEmbeds":
        t = tensor.contiguous()
        digest = hashlib.sha256(t.view(torch.uint8).numpy().tobytes())
        digest.update(repr((tuple(t.shape), str(t.dtype))).encode())
        key = digest.hexdigest()
        return cls(t, [("embeds", key, i) for i in range(t.shape[0])])

    # ---- what the runner reads (as it reads PromptImages) ------------------------------
    def images_in(self, start: int, end: int) -> list:
        return [0] if start < self.tensor.shape[0] and end > start else []

    def span(self, k: int) -> tuple:
        return 0, self.tensor.shape[0]

    def embeddings(self, k: int, model) -> torch.Tensor:
        return self.tensor

    def positions_1d(self, start: int, end: int) -> list:
        return list(range(start, end))

    def positions_3d(self, start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end, dtype=torch.int64).expand(3, -1)

    def release(self, num_computed: int) -> None:
        """Kept: a preempted request's prefill is recomputed from the tensor."""


def embeds_prompt(prompt, prompt_embeds, params, *, enabled: bool, hidden_size: int, dtype: torch.dtype,
                  max_model_len: int, images=None, kv_transfer_params=None) -> tuple:
    """(placeholder prompt ids, PromptEmbeds) of a request's ``prompt_embeds`` (a tensor, or the
    ``PromptEmbeds`` that ``make_prompt_embeds`` made of it off the engine thread), or a
    ValueError saying what is wrong."""
    from ..pooling_params import PoolingParams
    if not enabled:
        raise ValueError("prompt_embeds needs an engine built with enable_prompt_embeds=True")
    if prompt is not None:
        raise ValueError("give a prompt or prompt_embeds, not both")
    if images or kv_transfer_params:
        raise ValueError("prompt_embeds take no images and are not disaggregated (kv_transfer_params)")
    if isinstance(params, PoolingParams):
        raise ValueError("prompt_embeds are for generation: embeddings and classification take text or token ids")
    if getattr(params, "prompt_logprobs", None) is not None:
        raise ValueError("prompt_logprobs needs the prompt's token ids, which prompt_embeds do not have")
    pe = prompt_embeds if isinstance(prompt_embeds, PromptEmbeds) else make_prompt_embeds(
        prompt_embeds, params, hidden_size=hidden_size, dtype=dtype, max_model_len=max_model_len)
    return [PLACEHOLDER] * pe.tensor.shape[0], pe


def make_prompt_embeds(t, params, *, hidden_size: int, dtype: torch.dtype, max_model_len: int) -> PromptEmbeds:
    """The PromptEmbeds of a tensor ([P, hidden] or [1, P, hidden], any float dtype, cast to the
    model's), truncated as ``params`` ask and hashed: the tensor work, which the server does in a
    worker thread so that a large tensor does not stall the engine's steps."""
    from .intake import truncated
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise ValueError(f"prompt_embeds must be a floating-point torch.Tensor, got {type(t).__name__}"
                         + (f" of {t.dtype}" if isinstance(t, torch.Tensor) else ""))
    shape = list(t.shape)
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2 or t.shape[1] != hidden_size:
        raise ValueError(f"prompt_embeds must be [num_tokens, {hidden_size}] (the model's hidden size), "
                         f"got {shape}")
    if t.shape[0] == 0:
        raise ValueError("the prompt is empty")
    keep = truncated(list(range(t.shape[0])), params.truncate_prompt_tokens, max_model_len)
    t = t[keep[0]:] if keep else t[:0]
    t = t.detach().to("cpu", dtype)
    if not torch.isfinite(t).all():
        raise ValueError("prompt_embeds hold a NaN or an infinity")
    return PromptEmbeds.make(t)
