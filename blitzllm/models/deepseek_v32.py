"""DeepSeek-V3.2: DeepSeek-V3 (``deepseek_v3.py``) with sparse attention in every layer, MTP layers
included: ``layers/sparse_mla.py`` (MLA over the top ``index_topk`` tokens of a lightning indexer,
whose keys are each layer's second paged cache tensor). GLM-5 (``GlmMoeDsaForCausalLM``) on the
same code: interleaved rotary pairs in its indexer, and "shared" layers that attend to the tokens
the last "full" layer's indexer selected. Architecture only (docs/models.md).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from torch import nn

from ..config import ModelConfig
from ..layers.indexer import IndexerDims
from ..layers.rotary import RotaryEmbedding
from ..layers.sparse_mla import SparseMLAttention
from .deepseek_v3 import DeepseekV3Args, DeepseekV3ForCausalLM

# checkpoint names of the indexer's projections -> the attention's packed GEMMs they are shards of
_INDEXER_GEMMS = {".self_attn.indexer.wq_b.": ".self_attn.wq_b.", ".self_attn.indexer.wk.": ".self_attn.wk."}


@dataclass(frozen=True)
class DeepseekV32Args(DeepseekV3Args):
    indexer: Optional[IndexerDims] = None
    shared_layers: frozenset = frozenset()  # checkpoint layers without an indexer of their own (GLM-5)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "DeepseekV32Args":
        base = DeepseekV3Args.from_config(cfg)
        t = cfg.text_config
        missing = [k for k in ("index_n_heads", "index_head_dim", "index_topk") if not t.get(k)]
        if missing:
            raise ValueError(f"{cfg.architecture} needs {', '.join(missing)} in config.json")
        glm = cfg.architecture == "GlmMoeDsaForCausalLM"
        ix = IndexerDims(n_heads=int(t["index_n_heads"]), head_dim=int(t["index_head_dim"]),
                         topk=int(t["index_topk"]), rope_dim=cfg.qk_rope_head_dim,
                         interleave=bool(t.get("indexer_rope_interleave", glm)))
        types = _indexer_types(t, base.checkpoint_layers)
        if types and types[0] != "full":
            raise ValueError("indexer_types in config.json must start with 'full' (a 'shared' layer reuses the "
                             "selection of the last 'full' layer before it)")
        return cls(**{f.name: getattr(base, f.name) for f in fields(DeepseekV3Args)}, indexer=ix,
                   shared_layers=frozenset(i for i, kind in enumerate(types) if kind == "shared"))

    def attention(self, cache_idx: int, rotary: RotaryEmbedding, scale: float) -> nn.Module:
        # (an MTP layer's cache_idx is past the checkpoint's layers: it has an indexer)
        return SparseMLAttention(self.mla, self.indexer, cache_idx, rotary, scale,
                                 shared=cache_idx in self.shared_layers)


def _indexer_types(t: dict, layers: int) -> list:
    """Per checkpoint layer "full" or "shared": ``indexer_types``, else the ``index_topk_pattern``
    letters (F / S), else every ``index_topk_freq``-th layer from ``index_skip_topk_offset`` on
    full (transformers' GlmMoeDsaConfig rule; all full by default)."""
    if t.get("indexer_types"):
        return list(t["indexer_types"])
    pattern = t.get("index_topk_pattern")
    if pattern:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(int(t.get("index_topk_freq") or 1), 1), int(t.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    args_class = DeepseekV32Args

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.packed_modules = {**self.packed_modules, **SparseMLAttention.packed_modules(self.args.mla)}

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """The indexer's wq_b / wk load as shards of the attention's packed GEMMs (``packed_modules``)."""
        for theirs, ours in _INDEXER_GEMMS.items():
            if theirs in name:
                return name.replace(theirs, ours)
        return name


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    pass
