"""Sequence classifiers (cross-encoder rerankers among them): the dense decoder of ``llama.py``
with transformers' ``score`` head (Linear hidden -> num_labels, no bias) in place of the lm_head.
The engine pools the final hidden state (the last token's, as transformers' classifiers do;
``engine/pooling.py``) and hands the pooled rows to ``classify``; such a model never samples.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .llama import DecoderModel, LlamaForCausalLM


class LlamaForSequenceClassification(nn.Module):
    packed_modules = LlamaForCausalLM.packed_modules

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        # whole on every tensor-parallel rank (num_labels x hidden is small): rank 0 pools alone
        self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat tokens [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        raise RuntimeError(f"{self.config.architecture} classifies: it has no lm_head to sample from")

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled final hidden rows [N, hidden] -> class logits [N, num_labels], in float32 (vLLM's
        default head dtype for pooling models: the pooled rows are float32 sums already)."""
        return pooled.float() @ self.score.weight.float().t()


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    pass


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    pass
