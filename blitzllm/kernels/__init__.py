"""Kernels, one family per folder (gemv/, moe/, attention/, norm/, gdn/) or module (activation,
greedy sampling, fp8 weights): each launcher beside its plain-torch ``reference_*``, and a
public op that takes the Triton launcher for CUDA tensors and the reference elsewhere
(``_common.use_triton``). ``_common.py`` holds what the families share."""
