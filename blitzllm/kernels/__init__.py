"""Triton kernels of blitzllm (each op falls back to a torch reference off-GPU)."""
from ._common import HAS_TRITON
from .activation import silu_and_mul
from .paged_attention import paged_decode_attention, paged_prefill_attention
from .qk_norm_rope_cache import fused_qk_norm_rope_cache
from .rmsnorm import fused_add_rms_norm, rms_norm

__all__ = [
    "HAS_TRITON",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "fused_qk_norm_rope_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
]
