"""Linear layers whose weights may be packed from several checkpoint tensors.

A ``PackedLinear`` concatenates its shards along the output dimension (q/k/v, gate/up);
the loader copies each checkpoint tensor into its slice through ``load_shard``.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels import cpu_gemm
from ..kernels.activation import silu_and_mul
from ..kernels.gemv.gemv import linear as gemv_linear
from ..kernels.fp8_weights import DEFAULT_BLOCK as DEFAULT_FP8_BLOCK
from ..kernels.fp8_weights import fp8_linear, quantize_fp8_block
from ..kernels.cpu_quant import native, quant_matmul
from ..kernels.cpu_quant.pack import MANY_ROWS

_WEIGHT_ONLY_MAX_ROWS = 4  # up to this many rows weight-only layers read the stored weight (a GEMV), not a widened copy


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.register_buffer("qweight", None)  # packed int4 (quantize_int4) or int8 (quantize_int8)
        self.register_buffer("qscales_zeros", None)
        self.group_size = 0  # > 0: int4 groups of this size; -1: int8 per output channel
        # weight_dtype='fp8' (``quantize_fp8``): a float8 weight with fp32 scales per fp8_block
        self.register_buffer("weight_scale_inv", None)
        self.fp8_block: tuple | None = None
        # a GGUF checkpoint's grid kept on the CPU (loader/gguf_grid.py): kernels/cpu_quant's QuantWeight
        self.quant = None
        # kernel forms, set by the runner's decode plan (runner/decode_plan.py):
        # CUDA decode rows on the Triton GEMV (else cuBLAS)
        self.use_gemv = True
        # gate_up on that GEMV may apply the MLP's SiLU-and-mul in its epilogue (off under LoRA,
        # whose rows add in before the SiLU)
        self.glu_epilogue = True
        # decode at 1-2 rows through the TMA GEMV (kernels/gemv/gemv_tma.py), which streams its
        # weights before waiting on the kernel before: set on o_proj and qkv, which follow the
        # latency-bound decode attention and RMSNorm (those let it launch as they start:
        # ``tma_early``)
        self.tma_preload = False
        self.tma_early = True
        # CPU bf16: oneDNN's packed copy of the weight (kernels/cpu_gemm), set by the runner's CPU
        # decode path where memory allows
        self.cpu_packed = None

    def tma_ok(self, x: torch.Tensor) -> bool:
        """Whether ``forward(x)`` (and ``forward_norm``) runs the TMA GEMV."""
        if not self.tma_preload or self.qweight is not None or self.quant is not None or not self.use_gemv:
            return False
        from ..kernels.gemv.gemv_tma import tma_gemv_ok
        return tma_gemv_ok(x, self.weight)

    def forward(self, x: torch.Tensor, silu_mul_input: bool = False) -> torch.Tensor:
        """x [..., in] -> [..., out]. With ``silu_mul_input`` x is [..., 2*in] (gate, up) and
        the layer applies ``silu(gate) * up`` first, fused into the GEMV on CUDA decode."""
        if self.quant is not None:
            y = quant_matmul(silu_and_mul(x) if silu_mul_input else x, self.quant)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        if self.qweight is not None:
            return self._int4_forward(silu_and_mul(x) if silu_mul_input else x)
        if self.fp8_block is not None:
            return fp8_linear(silu_and_mul(x) if silu_mul_input else x, self.weight, self.weight_scale_inv,
                              self.fp8_block, self.bias)
        w = self.weight
        if not silu_mul_input and self.tma_ok(x):
            return self._tma_forward(x)
        if x.is_cuda and self.use_gemv and x.dtype == w.dtype:
            return gemv_linear(x, w, self.bias, silu_mul_input=silu_mul_input)
        if silu_mul_input:
            x = silu_and_mul(x)
        if self.cpu_packed is not None and x.dtype == w.dtype and x.device.type == "cpu":
            return cpu_gemm.matmul(x, w, self.cpu_packed, self.bias)
        if x.dtype != w.dtype:  # weight-only lower precision (CPU bf16 weights, fp32 activations)
            rows = x.numel() // x.shape[-1]
            if (rows < MANY_ROWS and w.dtype == torch.bfloat16 and x.dtype == torch.float32
                    and native.lib() is not None):
                # fp32 products from the bf16 weight (kernels/cpu_quant), not x rounded to bf16;
                # a batch of decode rows too (widening a large lm_head costs more than its GEMM)
                y = native.matmul(x.reshape(-1, x.shape[-1]).contiguous(), w, None, None)
                y = y.view(*x.shape[:-1], w.shape[0])
                return y if self.bias is None else y + self.bias.to(y.dtype)
            if rows > _WEIGHT_ONLY_MAX_ROWS:
                # many rows (prefill): a CPU low-precision GEMM is compute bound and slow;
                # widening the weight once costs only a read of it
                bias = None if self.bias is None else self.bias.to(x.dtype)
                return nn.functional.linear(x, w.to(x.dtype), bias)
            return nn.functional.linear(x.to(w.dtype), w, self.bias).to(x.dtype)
        return nn.functional.linear(x, w, self.bias)

    def forward_norm(self, x: torch.Tensor, residual, norm) -> tuple:
        """Pre-norm block entry, ``(self(norm(x + residual)), x + residual)`` for the RMSNorm module
        ``norm``; on the TMA GEMV's path the norm lets the GEMV launch as it starts."""
        # (x may be an MoE block's fp32 sum beside a lower-precision residual: the norm rounds it)
        xd = x if residual is None else residual
        if norm.tp is None:  # (a norm that all-reduces over tensor-parallel ranks runs on its own)
            if self.tma_ok(xd) and xd.dtype == norm.weight.dtype:  # the norm lets the GEMV launch at once
                from ..kernels.norm.rmsnorm import fused_add_rms_norm
                h, residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps, early_dependents=self.tma_early)
                return self._tma_forward(h), residual
            if residual is None:
                return self(norm(x)), x
        h, residual = norm(x, residual)
        return self(h), residual

    def _tma_forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels.gemv.gemv_tma import gemv_tma_triton
        rows = x.numel() // x.shape[-1]
        y = gemv_tma_triton(x.reshape(rows, x.shape[-1]), self.weight, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    # ---- block FP8 (weight_dtype='fp8') -------------------------------------------------
    def quantize_fp8(self, block: tuple = DEFAULT_FP8_BLOCK, pow2: bool = False) -> None:
        """The weight as float8 e4m3 with one fp32 scale per ``block`` ([rows, cols]; ``pow2``:
        power-of-two scales); forward then dequantizes its tiles inside the GEMM
        (``kernels/fp8_weights.py``)."""
        q, scale = quantize_fp8_block(self.weight.detach(), block, pow2)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale_inv = scale
        self.fp8_block = tuple(block)

    # ---- weight-only int4 (CPU) -------------------------------------------------------
    def quantize_int4(self, group_size: int = 32) -> None:
        """Asymmetric int4 per group of ``group_size`` input weights, w = (q - 8) * scale + zero
        (GGUF Q4_1): a Q4_0 / Q4_1 checkpoint's groups come back on their grid, up to the bf16
        rounding of scale and zero that torch's int4 CPU kernel takes."""
        w = self.weight.detach().float()
        n, k = w.shape
        g = w.view(n, k // group_size, group_size)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = (hi - lo) / 15
        step = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((g - lo[..., None]) / step[..., None]).clamp_(0, 15).to(torch.int32).view(n, k)
        zero = lo + 8 * scale
        self.qscales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.group_size = group_size
        self.weight = None
        if self.bias is not None:
            self.bias.data = self.bias.data.float()

    def quantize_int8(self) -> None:
        """Symmetric int8 per output channel (scale = max |w| / 127) through torch's int8 CPU
        kernel: the lm_head of weight_dtype='int4'."""
        w = self.weight.detach().float()
        scale = w.abs().amax(1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        self.qweight = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.qscales_zeros = scale.to(torch.bfloat16)
        self.group_size = -1
        self.weight = None
        if self.bias is not None:
            self.bias.data = self.bias.data.float()

    def _int4_forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        if self.group_size < 0:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.qscales_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size, self.qscales_zeros)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)


INT4_GROUP = 32


def quantize_linear_weights_int4(model: nn.Module, group_size: int = INT4_GROUP) -> int:
    """weight_dtype='int4' (CPU): every decoder Linear whose input size is a multiple of
    ``group_size`` and output size a multiple of 16 (torch's int4 packing; a 1-row gate such as
    Qwen3-Next's shared_expert_gate stays bf16) becomes weight-only int4, the lm_head int8 per
    output channel (GGUF keeps it in 8 bits, which int4 would coarsen). Returns the layers quantized."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        raise ValueError("weight_dtype='int4' needs torch >= 2.5 (its int4 CPU kernel)")
    cast_linear_weights(model, torch.bfloat16)
    lm_head = getattr(model, "lm_head", None)
    done = 0
    for mod in model.modules():
        if isinstance(mod, Linear) and mod is not lm_head and mod.in_features % group_size == 0 \
                and mod.out_features % 16 == 0:
            mod.quantize_int4(group_size)
            done += 1
    if isinstance(lm_head, Linear) and hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        lm_head.quantize_int8()
        done += 1
    return done


def quantize_fp8_weights(model: nn.Module, block: tuple = DEFAULT_FP8_BLOCK, pow2: bool = False) -> int:
    """weight_dtype='fp8': every decoder Linear (not the output heads) and MoE block's experts hold
    block-FP8 weights; norms, embeddings, routers and MLA's absorbed kv_b keep the model dtype.
    ``pow2``: power-of-two scales. Returns the modules quantized."""
    done = 0
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and mod.weight is not None and mod.fp8_block is None:
            if name.rsplit(".", 1)[-1] in ("lm_head", "head"):
                continue
            mod.quantize_fp8(block, pow2)
            done += 1
        elif callable(getattr(mod, "quantize_fp8", None)) and not isinstance(mod, Linear):
            mod.quantize_fp8(block, pow2)
            done += 1
    return done


def cast_linear_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """Store every Linear's weights in ``dtype`` (activations keep the model dtype). A
    tied lm_head gets its own copy, so the embedding lookup keeps full precision."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is not None and embed is not None and lm_head.weight is embed.weight:
        lm_head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
    for mod in model.modules():
        if isinstance(mod, Linear) and mod.weight is not None:
            mod.weight.data = mod.weight.data.to(dtype)
            if mod.bias is not None:
                mod.bias.data = mod.bias.data.to(dtype)


class PackedLinear(Linear):
    """Output dimension = sum(shard_sizes); shard i is loaded from checkpoint name i."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes), bias)
        self.shard_sizes = list(shard_sizes)

    def shard_slice(self, index: int) -> slice:
        start = sum(self.shard_sizes[:index])
        return slice(start, start + self.shard_sizes[index])
