"""LoRA kernels (``lora.py``): a row's adapter product added into a linear's output, by the
row's slot. Entry points ``lora_add_triton`` (decode rows), ``reference_lora_add`` (torch,
with ``slot_mask``) and the dispatch rule ``use_lora_kernels``."""
from .lora import KERNEL_MAX_ROWS, lora_add_triton, reference_lora_add, slot_mask, use_lora_kernels

__all__ = ["KERNEL_MAX_ROWS", "lora_add_triton", "reference_lora_add", "slot_mask", "use_lora_kernels"]
