"""Batch -> tensors -> logits -> sampled tokens.

Owns the model weights, the KV cache tensors and the attention backend. Turns the
scheduler's list of (request, token range) into flat input ids, positions and attention
metadata, runs the model inside a forward context and samples on the device. Knows nothing
about stop conditions or text.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import CacheConfig, ModelConfig
from ..layers.attention import AttentionMetadata, ForwardContext, forward_context, select_backend
from ..layers.sampler import Sampler, SamplingMetadata, SamplingRow
from ..loader.source import ModelSource
from ..loader.weights import init_dummy_weights, load_weights
from ..models.registry import get_model_class


@dataclass
class StepResult:
    token_ids: list           # one per sampled sequence
    logprobs: list            # chosen-token logprob per sampled sequence
    top: Optional[list]       # per sampled sequence: list of (id, logprob), or None


def build_model(src: ModelSource, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int):
    cls = get_model_class(cfg.architecture)
    with torch.device("meta"):
        model = cls(cfg)
    model = model.to_empty(device=device).to(dtype)
    # buffers computed at init (rotary tables) are lost by to_empty: rebuild them
    for mod in model.modules():
        if hasattr(mod, "cos_sin_cache"):
            from ..layers.rotary import build_cos_sin_cache
            mod.cos_sin_cache = build_cos_sin_cache(mod.rotary_dim, cfg.max_position_embeddings,
                                                    cfg.rope_theta, cfg.rope_scaling).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if src.tensors is None:
        init_dummy_weights(model, seed)
    else:
        load_weights(model, src.tensors(), src.num_tensors)
    model.eval()
    return model


class ModelRunner:
    def __init__(self, model, cfg: ModelConfig, cache: CacheConfig, device, dtype,
                 max_num_seqs: int = 256, max_model_len: int = 4096, enforce_eager: bool = False,
                 attention_backend: str = "auto"):
        self.model = model
        self.cfg = cfg
        self.cache_cfg = cache
        self.device = device
        self.dtype = dtype
        self.backend = select_backend(device, attention_backend)
        self.sampler = Sampler()
        shape = (cache.num_blocks, cache.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device)) for _ in range(cfg.num_layers)]
        self.graphs = None
        if device.type == "cuda" and not enforce_eager and self.backend.name == "triton":
            from .cuda_graphs import DecodeGraphs
            width = -(-max_model_len // cache.block_size)
            self.graphs = DecodeGraphs(model, self.kv_caches, self.backend, device, max_num_seqs, width)
            self.graphs.capture()

    def _to_dev(self, data, dtype):
        return torch.tensor(data, dtype=dtype, device="cpu").to(self.device, non_blocking=True)

    def prepare(self, seqs, block_tables):
        """seqs: list of (token_ids, start, end); block_tables: list of block id lists."""
        bs = self.cache_cfg.block_size
        ids, pos, slots, qsl, lens = [], [], [], [0], []
        for (toks, start, end), table in zip(seqs, block_tables):
            ids.extend(toks)
            pos.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(qsl[-1] + end - start)
            lens.append(end)
        width = max(len(t) for t in block_tables)
        bt = [t + [0] * (width - len(t)) for t in block_tables]
        q_lens = [qsl[i + 1] - qsl[i] for i in range(len(lens))]
        md = AttentionMetadata(
            slot_mapping=self._to_dev(slots, torch.int64),
            query_start_loc=self._to_dev(qsl, torch.int32),
            seq_lens=self._to_dev(lens, torch.int32),
            block_tables=self._to_dev(bt, torch.int32),
            max_q_len=max(q_lens), max_seq_len=max(lens),
            q_lens_host=q_lens, seq_lens_host=lens)
        return self._to_dev(ids, torch.int64), self._to_dev(pos, torch.int64), md, qsl

    def _decode_graph(self, seqs, block_tables) -> torch.Tensor:
        bs = self.cache_cfg.block_size
        ids, pos, slots, lens = [], [], [], []
        for (toks, start, end), table in zip(seqs, block_tables):
            ids.append(toks[0])
            pos.append(start)
            slots.append(table[start // bs] * bs + start % bs)
            lens.append(end)
        width = max(len(t) for t in block_tables)
        bt = [t + [0] * (width - len(t)) for t in block_tables]
        packed = torch.tensor([ids, pos, slots, lens], dtype=torch.int64).pin_memory().to(self.device, non_blocking=True)
        bt_dev = torch.tensor(bt, dtype=torch.int32).pin_memory().to(self.device, non_blocking=True)
        return self.graphs.run(packed, bt_dev)

    @torch.inference_mode()
    def execute(self, seqs, block_tables, sample_idx: list[int], rows: list[SamplingRow]) -> StepResult:
        """Run one step. ``sample_idx`` lists the batch rows that sample a token."""
        if self.graphs is not None and all(e - s == 1 for _, s, e in seqs) and self.graphs.can_run(len(seqs)):
            logits = self._decode_graph(seqs, block_tables)
            if not sample_idx:
                return StepResult([], [], None)
            if len(sample_idx) != len(seqs):
                logits = logits[torch.tensor(sample_idx, device=self.device)]
        else:
            input_ids, positions, md, qsl = self.prepare(seqs, block_tables)
            with forward_context(ForwardContext(md, self.kv_caches, self.backend)):
                hidden = self.model(input_ids, positions)
            if not sample_idx:
                return StepResult([], [], None)
            last = torch.tensor([qsl[i + 1] - 1 for i in sample_idx], device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, last))
        smd = SamplingMetadata.build(rows, self.cfg.vocab_size, self.device)
        out = self.sampler(logits, smd)
        tokens = out.token_ids.tolist()
        lps = out.logprobs.tolist()
        top = None
        if out.top_ids is not None:
            ti, tl = out.top_ids.tolist(), out.top_logprobs.tolist()
            top = [list(zip(a, b)) for a, b in zip(ti, tl)]
        return StepResult(tokens, lps, top)
