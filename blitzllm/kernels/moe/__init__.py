"""Mixture-of-experts kernels: the router GEMM, the expert selection (``routing.py``), the
post-attention norm + router launch (``router.py``) and the fused experts (``experts.py``:
grouped GEMMs over the chosen experts, a sort-free direct path for decode). Entry points:
``route_experts``, ``norm_route_experts``, ``fused_moe``; references ``reference_*``."""
from .router import (fused_moe, norm_route_experts, reference_fused_moe, reference_norm_route_experts,
                     reference_router_gemm, reference_select_experts, route_experts, router_gemm, select_experts)

__all__ = ["fused_moe", "norm_route_experts", "reference_fused_moe", "reference_norm_route_experts",
           "reference_router_gemm", "reference_select_experts", "route_experts", "router_gemm", "select_experts"]
