"""Frozen engine configuration: the model's shape, the KV cache, the scheduler.

``ModelConfig.from_hf`` reads a Hugging Face ``config.json`` dict; derived values are
properties. Nothing here touches tensors or devices.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    # MLA (DeepSeek): the cache holds one compressed latent plus the rope key per token and
    # layer (kv_lora_rank + qk_rope_head_dim values), not per-head k and v
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = ()
    # a sequence classifier (``*ForSequenceClassification``): its labels, by index; () for a causal LM
    labels: tuple = ()
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_classifier(self) -> bool:
        """A ``*ForSequenceClassification`` folder: a ``score`` head of ``num_labels`` rows in place
        of the lm_head; it classifies (and scores pairs), never generates."""
        return self.architecture.endswith("ForSequenceClassification")

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def text_config(self) -> dict:
        """The HF config's ``text_config`` (a multimodal folder's text model), else the config itself."""
        return self.hf_config.get("text_config") or self.hf_config

    @property
    def kv_cache_entry(self) -> tuple[int, int, int]:
        """(tensors per layer, heads, dim) of one cached token: (2, Hkv, D) for k and v,
        (1, 1, kv_lora_rank + qk_rope_head_dim) for MLA's latent cache."""
        if self.is_mla:
            return 1, 1, self.kv_lora_rank + self.qk_rope_head_dim
        return 2, self.num_kv_heads, self.head_dim

    def kv_cache_entry_for(self, tp_size: int) -> tuple[int, int, int]:
        """``kv_cache_entry`` of one of ``tp_size`` tensor-parallel ranks: its share of the KV
        heads (one replicated head when there are fewer heads than ranks); MLA's latent is
        replicated."""
        n, h, d = self.kv_cache_entry
        return n, (h if self.is_mla else max(1, h // tp_size)), d

    def kv_bytes_per_token(self, dtype_bytes: int, tp_size: int = 1, cache_bytes: Optional[int] = None) -> int:
        """Paged-cache bytes a token takes over all layers: its K/V (or latent) entries of
        ``cache_bytes`` each (the KV cache dtype's; default ``dtype_bytes``) and a sparse-attention
        indexer's keys, which stay in the model's dtype (``dtype_bytes``)."""
        n, h, d = self.kv_cache_entry_for(tp_size)
        kv = n * h * d * (dtype_bytes if cache_bytes is None else cache_bytes)
        return (kv + self.index_head_dim * dtype_bytes) * len(self.kv_layers)

    @property
    def index_head_dim(self) -> int:
        """Values per token and layer of a sparse-attention indexer's key cache, the second paged
        tensor of an MLA layer (DeepSeek-V3.2: ``index_head_dim`` with ``index_topk``); 0: none."""
        text = self.text_config
        return int(text.get("index_head_dim") or 0) if self.is_mla and text.get("index_topk") else 0

    @property
    def index_topk(self) -> int:
        """Cached tokens a query of a sparse-attention layer attends to (0: all, no indexer)."""
        return int(self.text_config.get("index_topk") or 0) if self.index_head_dim else 0

    @property
    def state_layers(self) -> tuple:
        """Indices of the layers that keep a recurrent state instead of a KV cache (the gated
        delta net layers of hybrid models: ``layer_types`` "linear_attention", or all but every
        ``full_attention_interval``-th layer)."""
        text = self.text_config
        types = text.get("layer_types")
        if types is None and text.get("full_attention_interval"):
            every = int(text["full_attention_interval"])
            types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(self.num_layers)]
        return tuple(i for i, t in enumerate((types or [])[:self.num_layers]) if t == "linear_attention")

    @property
    def kv_layers(self) -> tuple:
        """Indices of the layers with a paged KV cache."""
        skip = set(self.state_layers)
        return tuple(i for i in range(self.num_layers) if i not in skip)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], num_layers: Optional[int] = None) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        arch = archs[0]
        text = cfg.get("text_config") or cfg
        heads = text["num_attention_heads"]
        hidden = text["hidden_size"]
        head_dim = text.get("head_dim") or hidden // heads
        eos = text.get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        rope_scaling = text.get("rope_scaling")
        rope_theta = text.get("rope_theta")
        rp = text.get("rope_parameters")  # transformers >= 5 layout
        if isinstance(rp, dict):
            rope_theta = rope_theta or rp.get("rope_theta")
            if rp.get("rope_type", "default") != "default":
                rope_scaling = rope_scaling or rp
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        layers = text["num_hidden_layers"]
        if num_layers is not None:
            if num_layers < 1:
                raise ValueError(f"num_layers must be >= 1, got {num_layers}")
            layers = min(layers, num_layers)
        labels = _labels(cfg) if arch.endswith("ForSequenceClassification") else ()
        return cls(
            architecture=arch,
            vocab_size=text["vocab_size"],
            hidden_size=hidden,
            intermediate_size=text.get("intermediate_size", 0),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=text.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            max_position_embeddings=text.get("max_position_embeddings", 4096),
            # (a classifier has no lm_head to tie)
            tie_word_embeddings=not labels and bool(cfg.get("tie_word_embeddings",
                                                            text.get("tie_word_embeddings", False))),
            attention_bias=bool(text.get("attention_bias", arch.startswith("Qwen2For"))),
            qk_norm=arch.startswith("Qwen3"),
            kv_lora_rank=int(text.get("kv_lora_rank") or 0),
            qk_rope_head_dim=int(text.get("qk_rope_head_dim") or 0) if text.get("kv_lora_rank") else 0,
            bos_token_id=text.get("bos_token_id", cfg.get("bos_token_id")),
            eos_token_ids=eos_ids,
            labels=labels,
            hf_config=dict(cfg),
        )


def _labels(cfg: dict) -> tuple:
    """A classifier's label names by index, as transformers reads them: ``id2label`` (JSON keys
    are strings), else ``num_labels`` of ``LABEL_i`` (transformers' default is 2)."""
    id2label = cfg.get("id2label") or {}
    n = len(id2label) or int(cfg.get("num_labels") or 2)
    if n < 1:
        raise ValueError(f"a sequence classifier needs num_labels >= 1, got {n}")
    return tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n))


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 0
    enable_prefix_caching: bool = True
    num_state_rows: int = 0   # hybrid models: rows of the recurrent-state pool (engine/state_cache.py)
    num_state_spare: int = 0  # of those, the runner's decode look-ahead rows (just before the last)
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8: float8 e4m3 (kernels/attention/kv_store.py)


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    policy: str = "fcfs"  # fcfs | priority (engine/scheduler.py)

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
