"""Prefill/decode disaggregation: the KV connector interface (``base.py``), its configuration
(``config.py``), a producer's leases (``leases.py``) and the NIXL transport (``nixl.py``). Sits
below the engine: it sees the KV cache manager and the cache tensors the engine hands it, never
requests' sampling, HTTP routes or the scheduler's policy (docs/disaggregation.md).
"""
from __future__ import annotations

from typing import Optional

from .base import CacheLayout, KVConnector, KVLoadError, KVPayload, land_shard, prompt_digest
from .config import KVTransferConfig, parse_kv_transfer_config

__all__ = ["CacheLayout", "KVConnector", "KVLoadError", "KVPayload", "KVTransferConfig", "build_connector", "land_shard",
           "parse_kv_transfer_config", "prompt_digest"]


def build_connector(value, tp_size: int = 1, has_states: bool = False) -> Optional[KVConnector]:
    """The connector an engine's ``kv_transfer_config`` asks for (None without one); ValueError
    for what cannot move yet."""
    cfg = parse_kv_transfer_config(value)
    if cfg is None:
        return None
    if tp_size != 1 and cfg.is_producer:
        raise ValueError(f"a kv_producer needs tensor_parallel_size 1, got {tp_size}: its blocks are read from one "
                         "rank's cache (a consumer may have any size: a producer of size 1 feeds a consumer of size "
                         f"{tp_size} by re-slicing the KV heads)")
    if has_states:
        raise ValueError("kv_transfer_config: a hybrid model's recurrent states do not move yet (paged KV, MLA "
                         "latents and index keys do)")
    from .nixl import NixlConnector
    return NixlConnector(cfg)
