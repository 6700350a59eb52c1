"""Gated full attention (Qwen3-Next, Qwen3.5): the paged ``Attention`` with an output gate.

``q_proj`` gives, per query head, [q (D) | gate (D)]; q and k get per-head (1 + w) RMSNorms
(``OffsetRMSNorm``) and partial rotary (the model's ``RotaryEmbedding``), the attention output
is multiplied by sigmoid(gate) before o_proj. At load time q_proj's rows are split into the
gate rows and the q rows of one packed projection whose output is [gate | q | k | v], so that
[q | k | v] is the contiguous-column slice ``Attention`` takes.

Tensor parallel: as ``models/llama.py``'s ``DecoderAttention`` (query heads and KV heads of the
rank, gate rows with their query heads; o_proj's output a partial sum).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .parallel import Part, check_shape, packed_column_linear, read_block, row_linear
from ..distributed.parallel_state import get_tp_group, split_heads
from .attention import Attention
from .norm import OffsetRMSNorm


class GatedAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, layer_idx: int,
                 rotary, bias: bool = False):
        super().__init__()
        d = head_dim
        tp = get_tp_group()
        h = split_heads(num_heads, num_kv_heads, tp)
        self.num_heads, self.head_dim, self.q_start = h.num_heads, d, h.q_start
        self.q_rows = 2 * num_heads * d  # q_proj's rows in the checkpoint
        self.q_size = h.num_heads * d
        kv_part = Part(0, h.kv_start * d, h.num_kv_heads * d, num_kv_heads * d)
        q_part = Part(0, h.q_start * 2 * d, 2 * self.q_size, 2 * num_heads * d)
        self.qkv_proj = packed_column_linear(hidden, [2 * num_heads * d, num_kv_heads * d, num_kv_heads * d], tp,
                                             bias, parts=[q_part, kv_part, kv_part])
        self.o_proj = row_linear(num_heads * d, hidden, tp, part=Part(1, h.q_start * d, self.q_size, num_heads * d))
        self.q_norm = OffsetRMSNorm(d, eps)
        self.k_norm = OffsetRMSNorm(d, eps)
        self.attn = Attention(h.num_heads, h.num_kv_heads, d, layer_idx, rotary, self.q_norm, self.k_norm)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.attend_project(positions, self.qkv_proj(x))

    def attend_project(self, positions: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
        """o_proj(attention(q, k, v) * sigmoid(gate)) from the packed projection [gate | q | k | v]."""
        gate, qkv = proj[:, :self.q_size], proj[:, self.q_size:]
        return self.o_proj(self.attn(positions, qkv) * torch.sigmoid(gate))

    def load_checkpoint(self, sub: str, tensor, name: str) -> Optional[list]:
        """q_proj's weight (or bias): this rank's heads' q rows and gate rows into the packed
        projection's first shard; None for the other tensors (the loader's packed mapping)."""
        leaf = sub.rpartition(".")[2]
        if sub not in ("q_proj.weight", "q_proj.bias"):
            return None
        dst, d = getattr(self.qkv_proj, leaf), self.head_dim
        check_shape(tensor, (self.q_rows, *dst.shape[1:]), name)
        with torch.no_grad():
            for j in range(self.num_heads):
                src = (self.q_start + j) * 2 * d
                dst[self.q_size + j * d:self.q_size + (j + 1) * d].copy_(read_block(tensor, [slice(src, src + d)]))
                dst[j * d:(j + 1) * d].copy_(read_block(tensor, [slice(src + d, src + 2 * d)]))
        return [f"{name[:-len(sub)]}qkv_proj.{leaf}#0"]
