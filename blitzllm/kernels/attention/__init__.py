"""Attention kernels over the paged KV cache: split-K decode (with the q/k norm, rotary and
cache write fused in) and varlen causal prefill (``paged.py`` launchers and references,
``paged_kernels.py`` the Triton kernels), the prefill's fused q/k norm + rotary + cache write
(``qk_norm_rope_cache.py``), multi-head latent attention: decode in the absorbed form
(``mla_decode.py``) and the latent prep (``mla_prep.py``), and DeepSeek-V3.2's sparse attention:
the lightning indexer's prep and logits (``indexer.py``), the top-k selection (``topk.py``) and
sparse MLA (``sparse_mla.py``)."""
from .paged import paged_decode_attention, paged_prefill_attention
from .qk_norm_rope_cache import fused_qk_norm_rope_cache

__all__ = ["fused_qk_norm_rope_cache", "paged_decode_attention", "paged_prefill_attention"]
