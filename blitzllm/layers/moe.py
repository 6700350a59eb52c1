"""Sparse mixture-of-experts block: a router (``gate``), stacked expert weights [E, 2I, H] and
[E, H, I], their tensor-parallel split and the checkpoint mapping of per-expert tensors onto
them. Shared by Qwen3-MoE, MiniMax-M2, DeepSeek-V3 and Qwen3-Next; the routing ops come from
``kernels/moe/router.py``. Knows nothing about attention or models (docs/models.md).

A gated shared expert as wide as a routed one may be stacked as expert E (``stack_shared_expert``,
the runner's choice): a one-token decode step then routes to it as one more entry of the grouped
GEMMs, its gate a router row, instead of running it and its gate as six launches of their own.
"""
from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from .. import envs
from .linear import Linear
from .parallel import Part, check_shape, copy_part, read_block
from ..distributed.parallel_state import TPGroup, get_tp_group

SCORINGS = ("softmax", "sigmoid")
MIN_EXPERT_SLICE = 128  # split by expert when a rank's slice of I would be thinner


def moe_split(num_experts: int, intermediate: int, tp: TPGroup) -> str:
    """How a tensor-parallel MoE block is split: "tensor" (every rank a slice of each expert's I)
    or "expert" (E / ranks whole experts each), by ``BLITZ_MOE_SPLIT`` or the slice's width."""
    n = tp.world_size
    mode = envs.get("BLITZ_MOE_SPLIT")
    if mode == "auto":
        thin = intermediate % n or intermediate // n < MIN_EXPERT_SLICE
        mode = "expert" if num_experts % n == 0 and thin else "tensor"
    if mode == "expert" and num_experts % n:
        raise ValueError(f"the number of experts ({num_experts}) must be divisible by tensor_parallel_size ({n}) "
                         "to split them by expert")
    if mode == "tensor" and intermediate % n:
        raise ValueError(f"moe_intermediate_size ({intermediate}) must be divisible by tensor_parallel_size ({n}) "
                         "to split the experts by tensor")
    return mode


def _op(name: str):
    """kernels/moe/router.py's dispatch function ``name`` (Triton on CUDA, torch otherwise), or its
    ``reference_<name>`` where the dispatcher does not exist. Imported on first use, so a
    dense model never loads the MoE kernels."""
    from ..kernels.moe import router as ops
    return getattr(ops, name, None) or getattr(ops, f"reference_{name}")


class Router(nn.Module):
    """The gate: ``weight`` [E, H], optional ``e_score_correction_bias`` [E] (selection only)."""

    def __init__(self, hidden: int, num_experts: int, correction_bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False) \
            if correction_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> fp32 router logits [T, E]."""
        return _op("router_gemm")(x, self.weight)


class FusedMoE(nn.Module):
    """Routed experts (top-k of E) plus optional shared experts (any [T, H] -> [T, H] module,
    added); forward x [T, H] -> [T, H], a partial sum under tensor parallelism. ``correction_bias``:
    where the checkpoint keeps ``e_score_correction_bias`` ("gate": the router; "block": the block).
    Parameters ``gate.weight`` [E, H], ``w13`` [E, 2I, H] (gate rows, then up), ``w2`` [E, H, I]."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 scoring: str = "softmax", correction_bias: Optional[str] = None,
                 n_group: int = 1, topk_group: int = 1, renormalize: bool = True, scaling: float = 1.0,
                 shared_experts: Optional[nn.Module] = None,
                 expert_names: tuple = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        if scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
        if correction_bias not in (None, "gate", "block"):
            raise ValueError(f"correction_bias must be None, 'gate' or 'block', got {correction_bias!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        if n_group > 1 and (num_experts % n_group or not 1 <= topk_group <= n_group):
            raise ValueError(f"n_group={n_group} must divide num_experts={num_experts} and "
                             f"topk_group={topk_group} must be in [1, n_group]")
        self.hidden, self.intermediate = hidden, intermediate
        self.num_experts, self.top_k = num_experts, top_k
        self.scoring, self.n_group, self.topk_group = scoring, n_group, topk_group
        self.renormalize, self.scaling = renormalize, float(scaling)
        self.expert_names = tuple(expert_names)  # checkpoint names of (gate, up, down) per expert
        self.gate = Router(hidden, num_experts, correction_bias == "gate")
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False) \
            if correction_bias == "block" else None
        # this rank's experts [expert_start, + num_local_experts) (expert_start None: all of
        # them) and slice [inter_start, + local_intermediate) of each
        self.expert_start, self.num_local_experts = None, num_experts
        self.inter_start, self.local_intermediate = 0, intermediate
        tp = get_tp_group()
        if tp.world_size > 1:
            if moe_split(num_experts, intermediate, tp) == "expert":
                self.num_local_experts = num_experts // tp.world_size
                self.expert_start = tp.rank * self.num_local_experts
            else:
                self.inter_start, self.local_intermediate = tp.split(intermediate, "moe_intermediate_size")
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.local_intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden, self.local_intermediate))
        self.fp8_block: Optional[tuple] = None  # weight_dtype='fp8': float8 w13 / w2 (``quantize_fp8``)
        self.shared_experts = shared_experts
        # set by a model whose next op after this block is a residual add + RMSNorm that rounds
        # an fp32 input itself (``rmsnorm.fused_add_rms_norm``): then decode may return the
        # routed experts' fp32 sum before its rounding (``fused_moe_triton(fp32_sum=True)``)
        self.fp32_sum = False
        # (w13, w2, router weight) with the shared expert stacked as expert E: ``stack_shared_expert``
        self.stacks: Optional[tuple] = None

    def quantize_fp8(self, block: tuple, pow2: bool = False) -> None:
        """w13 and w2 as float8 e4m3 with fp32 scales per ``block`` of each expert's matrix
        (``w13_scale_inv`` [E, ceil(2I / bn), ceil(H / bk)], ``w2_scale_inv``); the grouped GEMMs
        dequantize their tiles (``kernels/fp8_weights.py``; ``pow2``: power-of-two scales)."""
        from ..kernels.fp8_weights import quantize_fp8_block
        for name in ("w13", "w2"):
            q, scale = quantize_fp8_block(getattr(self, name).detach(), block, pow2)
            setattr(self, name, nn.Parameter(q, requires_grad=False))
            self.register_buffer(f"{name}_scale_inv", scale)
        self.fp8_block = tuple(block)

    @property
    def fp8_scales(self) -> Optional[tuple]:
        """(w13's scales, w2's, block) of float8 experts, else None."""
        return None if self.fp8_block is None else (self.w13_scale_inv, self.w2_scale_inv, self.fp8_block)

    @property
    def correction_bias(self) -> Optional[torch.Tensor]:
        b = self.e_score_correction_bias
        return self.gate.e_score_correction_bias if b is None else b

    # ---- the shared expert stacked as expert E ----------------------------------------------
    def shared_parts(self) -> Optional[tuple]:
        """(shared expert MLP, its gate ``Linear`` [1, H] (weight sigmoid(gate(x)))) of a block
        with a gated shared expert, else None. (An ungated one, DeepSeek-V3's, stacked with
        weight 1 measured no faster: docs/perf-history.md.)"""
        return None

    def stack_shared_expert(self) -> bool:
        """Stack the gated shared expert's weights as expert E of w13 / w2 and its gate as router
        row E, for one-token steps (``_stacked``). The block's, the router's and the shared
        expert's parameters become views of the stacks, so their names, shapes and values are
        as before (exports, the roofline, larger batches). Returns False and changes nothing
        where the shared expert does not fit: none, another width or dtype than a routed
        expert, quantized, biased, or the block split over ranks."""
        parts = self.shared_parts()
        if parts is None or self.stacks is not None or self.fp8_block is not None or self.expert_start is not None \
                or self.local_intermediate != self.intermediate:
            return False
        mlp, gate = parts
        gu, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
        ok = all(isinstance(m, Linear) and m.bias is None and m.qweight is None and m.quant is None
                 and m.fp8_block is None for m in (gu, down, gate))
        E, I, H = self.num_experts, self.intermediate, self.hidden
        if not ok or gu.weight.shape != (2 * I, H) or down.weight.shape != (H, I) or gate.weight.shape != (1, H) \
                or not gu.weight.dtype == down.weight.dtype == self.w13.dtype == gate.weight.dtype:
            return False
        with torch.no_grad():
            w13 = torch.cat([self.w13.detach(), gu.weight.detach()[None]])
            w2 = torch.cat([self.w2.detach(), down.weight.detach()[None]])
            router = torch.cat([self.gate.weight.detach(), gate.weight.detach()])
        for mod, name, view in ((self, "w13", w13[:E]), (gu, "weight", w13[E]), (self, "w2", w2[:E]),
                                (down, "weight", w2[E]), (self.gate, "weight", router[:E]), (gate, "weight", router[E:])):
            setattr(mod, name, nn.Parameter(view, requires_grad=getattr(mod, name).requires_grad))
        self.stacks = (w13, w2, router)
        return True

    def _stacked(self, x: torch.Tensor) -> bool:
        """Whether x's batch takes the stacked shared expert: where its entries fit the experts'
        direct (decode) path. On larger batches it measured slower than the shared expert's own
        launches (qwen3-next, batch 32: docs/perf-history.md)."""
        if self.stacks is None:
            return False
        from ..kernels.moe.experts import MOE_DIRECT_MAX_ENTRIES
        return x.shape[0] * (self.top_k + 1) <= MOE_DIRECT_MAX_ENTRIES

    def _router(self, stacked: bool) -> tuple:
        """(router weight, shared_gate) of a batch that does (not) take the stacked shared expert."""
        return (self.stacks[2], True) if stacked else (self.gate.weight, False)

    # ---- forward ---------------------------------------------------------------------------
    def route(self, x: torch.Tensor, stacked: bool = False):
        """x [T, H] -> (topk weights [T, K] fp32, topk ids [T, K] int32); ``stacked``: K + 1
        entries, the shared expert's last."""
        weight, gated = self._router(stacked)
        return _op("route_experts")(x, weight, self.top_k, self.scoring, self.correction_bias,
                                     self.n_group, self.topk_group, self.renormalize, self.scaling, gated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stacked = self._stacked(x)
        return self._experts(x, lambda h: self.route(h, stacked), stacked)

    def norm_route_ok(self, x: torch.Tensor, residual: Optional[torch.Tensor], norm: nn.Module) -> bool:
        """Whether ``forward_norm`` fuses the norm with the routing (decode; see
        ``kernels.moe.router.norm_route_experts``)."""
        from .norm import RMSNorm
        return (residual is not None and isinstance(norm, RMSNorm) and norm.tp is None
                and residual.shape == x.shape and _op("norm_route_ok")(x))

    def forward_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor], norm: nn.Module) -> tuple:
        """(self(norm(x + residual)), x + residual) for an RMSNorm ``norm``: where
        ``norm_route_ok`` the residual add, the norm and the router GEMM in one launch, the
        selection in the next."""
        stacked = self._stacked(x)
        weight, gated = self._router(stacked)
        h, residual, weights, ids = _op("norm_route_experts")(
            x, residual, norm.weight, norm.eps, weight, self.top_k, self.scoring, self.correction_bias,
            self.n_group, self.topk_group, self.renormalize, self.scaling, gated)
        return self._experts(h, lambda _: (weights, ids), stacked), residual

    def _experts(self, x: torch.Tensor, route, stacked: bool = False) -> torch.Tensor:
        """Routed (``route(x)`` -> topk weights, ids) plus shared experts of x [T, H], all on the
        current stream; ``stacked``: the shared expert is the routing's last entry."""
        weights, ids = route(x)
        if stacked:
            return _op("fused_moe")(x, self.stacks[0], self.stacks[1], weights, ids, fp32_sum=self.fp32_sum)
        if self.expert_start is None:
            # (an fp32 sum only where nothing is added to it here and no rank sums it after)
            fp32 = (self.fp32_sum and self.shared_experts is None and self.shared_parts() is None
                    and self.local_intermediate == self.intermediate)
            out = _op("fused_moe")(x, self.w13, self.w2, weights, ids, fp32_sum=fp32, scales=self.fp8_scales)
        else:  # split by expert: the other ranks' experts become id -1 with weight 0
            local = ids - self.expert_start
            mine = (local >= 0) & (local < self.num_local_experts)
            out = _op("fused_moe")(x, self.w13, self.w2, weights * mine, torch.where(mine, local, -1),
                                   dropped_ids=True, scales=self.fp8_scales)
        return out if self.shared_experts is None else out + self.shared_experts(x)


# ---- checkpoint mapping --------------------------------------------------------------

# <block>.experts.<e>.<proj>.weight (per expert, as checkpoints on disk) or
# <block>.experts.gate_up_proj / .down_proj (transformers' fused in-memory layout)
_PER_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
_FUSED = re.compile(r"^(?P<block>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)$")
HF_FUSED_NAMES = {"w13": "gate_up_proj", "w2": "down_proj"}


def _key(block: str, e: int, part: str) -> str:
    return f"{block}.experts.{e}.{part}"


def _stacked_keys(block: str, moe: "FusedMoE", leaf: str) -> list:
    """Load keys of every expert's slice of the stacked parameter ``leaf`` (w13 or w2)."""
    names = moe.expert_names[:2] if leaf == "w13" else moe.expert_names[2:]
    return [_key(block, e, p) for e in range(moe.num_experts) for p in names]


def load_expert_weight(model: nn.Module, name: str, tensor: torch.Tensor) -> Optional[list]:
    """A ``load_custom_weight`` for expert tensors: copies ``name`` into its ``FusedMoE``'s stacked
    weights and returns the load keys it filled; None when ``name`` is no expert tensor here (the
    loader then skips layers past a ``num_layers`` override and rejects the rest)."""
    m = _PER_EXPERT.match(name) or _FUSED.match(name)
    if m is None:
        return None
    block = m["block"]
    moe = find_module(model, block)
    if not isinstance(moe, FusedMoE):
        return None
    proj = m["proj"]
    full, inter, i0 = moe.intermediate, moe.local_intermediate, moe.inter_start
    e0, ne = moe.expert_start or 0, moe.num_local_experts
    if m.groupdict().get("e") is not None:
        e = int(m["e"])
        if not 0 <= e < moe.num_experts or proj not in moe.expert_names:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        if not e0 <= e < e0 + ne:
            return [_key(block, e, proj)]  # another rank's expert
        part = moe.expert_names.index(proj)
        sliced = inter != full
        if part < 2:
            copy_part(moe.w13[e - e0, part * inter:(part + 1) * inter], tensor,
                      Part(0, i0, inter, full) if sliced else None, name)
        else:
            copy_part(moe.w2[e - e0], tensor, Part(1, i0, inter, full) if sliced else None, name)
        return [_key(block, e, proj)]
    leaf = "w13" if proj == "gate_up_proj" else "w2"
    dst = getattr(moe, leaf)
    full_shape = (moe.num_experts, 2 * full, moe.hidden) if leaf == "w13" else (moe.num_experts, moe.hidden, full)
    check_shape(tensor, full_shape, name)
    experts = slice(e0, e0 + ne)
    with torch.no_grad():
        if leaf == "w13":  # this rank's rows of the gate half, then of the up half
            for half in (0, 1):
                rows = slice(half * full + i0, half * full + i0 + inter)
                dst[:, half * inter:(half + 1) * inter].copy_(read_block(tensor, [experts, rows]))
        else:
            dst.copy_(read_block(tensor, [experts, slice(None), slice(i0, i0 + inter)]))
    return _stacked_keys(block, moe, leaf)


def expert_load_keys(model: nn.Module, param_name: str) -> Optional[list]:
    """A ``required_load_keys``: the per-expert keys that must all be loaded for a stacked
    parameter (``<block>.w13`` / ``<block>.w2``); None for any other parameter."""
    block, _, leaf = param_name.rpartition(".")
    if leaf not in HF_FUSED_NAMES:
        return None
    moe = find_module(model, block)
    return _stacked_keys(block, moe, leaf) if isinstance(moe, FusedMoE) else None


def hf_expert_tensors(block: str, moe: FusedMoE, leaf: str, param: torch.Tensor,
                      per_expert: bool = False) -> dict:
    """The inverse of ``load_expert_weight`` for one stacked parameter: transformers' fused
    names (views) or, with ``per_expert``, the checkpoint's per-expert names (views)."""
    if not per_expert:
        return {f"{block}.experts.{HF_FUSED_NAMES[leaf]}": param}
    gate, up, down = moe.expert_names
    inter, out = moe.local_intermediate, {}
    for e in range(moe.num_experts):
        if leaf == "w13":
            out[f"{_key(block, e, gate)}.weight"] = param[e, :inter]
            out[f"{_key(block, e, up)}.weight"] = param[e, inter:]
        else:
            out[f"{_key(block, e, down)}.weight"] = param[e]
    return out


def find_module(model: nn.Module, path: str) -> Optional[nn.Module]:
    """``model.get_submodule(path)``, or None where there is no such module."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None
