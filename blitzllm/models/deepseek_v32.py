"""DeepSeek-V3.2: DeepSeek-V3 (``deepseek_v3.py``) with sparse attention in every layer, MTP layers
included: ``layers/sparse_mla.py`` (MLA over the top ``index_topk`` tokens of a lightning indexer,
whose keys are each layer's second paged cache tensor). Architecture only (docs/models.md).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from torch import nn

from ..config import ModelConfig
from ..layers.indexer import Fp32Params, IndexerDims
from ..layers.rotary import RotaryEmbedding
from ..layers.sparse_mla import SparseMLAttention
from .deepseek_v3 import DeepseekV3Args, DeepseekV3ForCausalLM, MTPModules

# checkpoint names of the indexer's projections -> the attention's packed GEMMs they are shards of
_INDEXER_GEMMS = {".self_attn.indexer.wq_b.": ".self_attn.wq_b.", ".self_attn.indexer.wk.": ".self_attn.wk."}


@dataclass(frozen=True)
class DeepseekV32Args(DeepseekV3Args):
    indexer: Optional[IndexerDims] = None

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "DeepseekV32Args":
        base = DeepseekV3Args.from_config(cfg)
        t = cfg.hf_config.get("text_config") or cfg.hf_config
        missing = [k for k in ("index_n_heads", "index_head_dim", "index_topk") if not t.get(k)]
        if missing:
            raise ValueError(f"{cfg.architecture} needs {', '.join(missing)} in config.json")
        ix = IndexerDims(n_heads=int(t["index_n_heads"]), head_dim=int(t["index_head_dim"]),
                         topk=int(t["index_topk"]), rope_dim=cfg.qk_rope_head_dim,
                         interleave=bool(t.get("indexer_rope_interleave", False)))
        return cls(**{f.name: getattr(base, f.name) for f in fields(DeepseekV3Args)}, indexer=ix)

    def attention(self, cache_idx: int, rotary: RotaryEmbedding, scale: float) -> nn.Module:
        return SparseMLAttention(self.mla, self.indexer, cache_idx, rotary, scale)


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

    def _new_mtp(self) -> MTPModules:
        mtp = super()._new_mtp()
        for mod in mtp.modules():  # (the base casts every parameter to the model dtype)
            if isinstance(mod, Fp32Params):
                mod.float()
        return mtp
