"""The LoRA slot pool and the wrapped linears.

``LoRAManager`` is built by the runner when ``enable_lora``: it wraps every q/k/v, o, gate/up
and down projection of a dense decoder so its output gains ``scale * (x @ A^T) @ B^T`` of the
row's slot, and owns ``max_loras`` slots, per wrapped module A [slots, S * R, in] and B^T
[slots, S * R, out] on the device (S: the module's slices, R: max_lora_rank; a slice's B sits
in its own rank rows and output columns, zeros elsewhere, so a fused module takes one A and one
B product). Adapters are read from disk on first use (kept in a small host LRU), copied into a
slot when a step needs them, and a slot no request of the step uses is given back least
recently used first. The engine's scheduler guarantees a step never needs more than
``max_loras``.

A step's LoRA products (``kernels/lora``): decode rows on CUDA run two kernels a linear, each
row reading only its own slot; other steps run every row through every slot's A at once
(``x @ A_all^T`` [rows, slots * S * R]) with a one-hot mask of the row's slot before the B
product. Neither form's shapes depend on which rows hold which adapter, so the decode CUDA
graphs capture them (the row slots are one more graph input, ``runner/cuda_graphs.py``).

The engine calls ``prepare_step`` with each scheduled sequence's adapter; the runner asks
``mapping`` (eager forwards) or ``rows`` (graph captures) for the step's ``LoRARows`` and hands
them to the layers in the forward context.

Tensor parallelism: every rank wraps its own shards and holds its part of each slot
(``adapter.slice_parts``). Rank 0 alone reads adapters and decides the slots; its step message
(``step_message``) carries the step's row slots and the adapters it loaded since the last one,
whole, which each worker copies its part of (``apply_step``), so the workers read no files.
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from functools import partial
from typing import NamedTuple, Optional

import torch

from ..kernels.activation import silu_and_mul
from ..kernels.lora import lora_add_triton, reference_lora_add, slot_mask, use_lora_kernels
from ..layers.attention import get_forward_context
from ..layers.parallel import copy_part
from .adapter import LoRAAdapter, b_columns, load_adapter, slice_parts
from .request import LoRAConfig, LoRARequest

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_WRAPPED = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class LoRARows(NamedTuple):
    """A step's rows for the wrapped linears (``ForwardContext.lora``)."""
    slots: torch.Tensor                 # [rows] int64: each row's slot, -1 for the base model
    mask: Optional[torch.Tensor]        # their one-hot where the step takes the torch form, else None


class LoRAManager:
    def __init__(self, model, architecture: str, cfg: LoRAConfig, device: torch.device, dtype: torch.dtype,
                 tp_size: int = 1):
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"enable_lora supports {', '.join(SUPPORTED_ARCHITECTURES)}; "
                             f"this model is {architecture}")
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.rank = cfg.max_lora_rank
        self.modules: dict = {}     # path -> the wrapped Linear
        self.slots_a: dict = {}     # path -> [slots, S * R, in]
        self.slots_b: dict = {}     # path -> [slots, S * R, out] (B transposed)
        n = cfg.max_loras
        for i, layer in enumerate(model.model.layers):
            for sub in _WRAPPED:
                mod = layer.get_submodule(sub)
                path = f"model.layers.{i}.{sub}"
                shards = getattr(mod, "shard_sizes", [mod.out_features])
                self.modules[path] = mod
                self.slots_a[path] = torch.zeros(n, len(shards) * self.rank, mod.in_features, dtype=dtype, device=device)
                self.slots_b[path] = torch.zeros(n, len(shards) * self.rank, mod.out_features, dtype=dtype, device=device)
                _wrap(mod, sub, self.slots_a[path], self.slots_b[path])
        self.slot_keys: list = [None] * n          # the adapter key each slot holds
        self.lru: OrderedDict = OrderedDict()      # slot -> None, least recently used first
        self.cpu: OrderedDict = OrderedDict()      # adapter key -> LoRAAdapter read from disk
        self.step_slots: list = []                 # per scheduled sequence of the step: slot or -1
        self.slot_loads = 0
        self.unsent = [] if tp_size > 1 else None  # rank 0: (slot, adapter) loaded since the last step message
        print(f"[blitz] LoRA: {len(self.modules)} linears wrapped, {n} slot(s) of rank {self.rank} "
              "(no fused CPU decode)", file=sys.stderr)

    # ---- adapters -----------------------------------------------------------------
    def resolve(self, req: LoRARequest) -> LoRAAdapter:
        """The adapter read (and checked) from ``req``'s folder; a ValueError if it cannot be served."""
        if not isinstance(req, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(req).__name__}")
        key = ("lora", req.lora_int_id, req.lora_path)
        hit = self.cpu.get(key)
        if hit is not None:
            self.cpu.move_to_end(key)
            return hit
        adapter = load_adapter(req, self.modules, self.rank, self.dtype)
        self.cpu[key] = adapter
        while len(self.cpu) > (self.cfg.max_cpu_loras or self.cfg.max_loras):
            self.cpu.popitem(last=False)   # (requests that hold it keep it alive)
        return adapter

    def check(self, req: LoRARequest) -> LoRAAdapter:
        """``req``'s adapter read and checked without caching it (a ValueError if it cannot be
        served): safe from any thread, it reads only the wrapped modules' shapes."""
        return load_adapter(req, self.modules, self.rank, self.dtype)

    # ---- the step -----------------------------------------------------------------
    def prepare_step(self, adapters: list) -> None:
        """``adapters``: per scheduled sequence its LoRAAdapter or None. Loads the ones not in a
        slot (evicting slots this step does not use, least recently used first)."""
        need = {a.key: a for a in adapters if a is not None}
        if len(need) > len(self.slot_keys):
            raise RuntimeError(f"a step needs {len(need)} adapters but there are {len(self.slot_keys)} slots")
        where = {k: s for s, k in enumerate(self.slot_keys) if k in need}
        for key, adapter in need.items():
            if key not in where:
                where[key] = self._load(adapter, set(where.values()))
            self.lru.pop(where[key], None)
            self.lru[where[key]] = None
        self.step_slots = [-1 if a is None else where[a.key] for a in adapters]

    def _load(self, adapter: LoRAAdapter, busy: set) -> int:
        free = [s for s, k in enumerate(self.slot_keys) if k is None]
        slot = free[0] if free else next(s for s in self.lru if s not in busy)
        self.lru.pop(slot, None)
        self._copy_in(slot, adapter)
        if self.unsent is not None:
            self.unsent.append((slot, adapter))
        return slot

    def _copy_in(self, slot: int, adapter: LoRAAdapter) -> None:
        """``adapter`` into ``slot``: this rank's part of each A and B (zeros where it has none)."""
        r, R = adapter.rank, self.rank
        for path, mod in self.modules.items():
            a, b = self.slots_a[path][slot], self.slots_b[path][slot]
            a.zero_()
            b.zero_()
            a_part, b_parts = slice_parts(mod)
            for i, ab in enumerate(adapter.weights.get(path, ())):
                if ab is None:
                    continue
                rows = mod.shard_slice(i) if hasattr(mod, "shard_slice") else slice(0, mod.out_features)
                copy_part(a[i * R:i * R + r], ab[0], a_part, f"{path} lora_A")
                copy_part(b[i * R:i * R + r, rows], ab[1].t(), b_parts[i] and b_columns(b_parts[i]), f"{path} lora_B")
        self.slot_keys[slot] = adapter.key
        self.slot_loads += 1

    # ---- tensor parallelism ---------------------------------------------------------
    def step_message(self) -> tuple:
        """Rank 0: what the workers need for the step it broadcasts (``apply_step``'s arguments)."""
        loads, self.unsent = self.unsent, []
        return tuple(self.step_slots), loads

    def apply_step(self, step_slots: tuple, loads: list) -> None:
        """A worker: rank 0's slot loads, then its step's row slots."""
        for slot, adapter in loads:
            self._copy_in(slot, adapter)
        self.step_slots = list(step_slots)

    def row_slots(self, counts: Optional[list] = None) -> list:
        """Each row's slot (-1: the base model) for the step's sequences of ``counts`` rows each
        (default one each, a decode step)."""
        if counts is None:
            return list(self.step_slots)
        return [s for s, c in zip(self.step_slots, counts) for _ in range(c)]

    def rows(self, row_slots: torch.Tensor) -> LoRARows:
        """The layers' view of ``row_slots`` [rows] (on the device): with the one-hot mask unless
        the step's rows take the kernels."""
        mask = None if use_lora_kernels(row_slots) else slot_mask(row_slots, len(self.slot_keys), self.dtype)
        return LoRARows(row_slots, mask)

    def mapping(self, qsl: list) -> Optional[LoRARows]:
        """The step's rows (``qsl``: the batch's query start offsets); None when no sequence of
        the step has an adapter (the base model's rows add nothing)."""
        if all(s < 0 for s in self.step_slots):
            return None
        slots = self.row_slots([qsl[i + 1] - qsl[i] for i in range(len(self.step_slots))])
        return self.rows(torch.tensor(slots, device=self.device))

    def stats(self) -> dict:
        return {"lora_slots_used": sum(k is not None for k in self.slot_keys), "lora_slot_loads": self.slot_loads}


def _wrap(mod, name: str, slots_a: torch.Tensor, slots_b: torch.Tensor) -> None:
    """Give ``mod`` an instance ``forward`` that adds the LoRA rows to its own. The decode forms
    that run inside ``forward`` stay (the GEMV, its SiLU-and-mul input, o_proj's TMA GEMV); those
    that bypass it are switched off: gate/up's GEMV epilogue (silu would come before the LoRA
    adds in) and qkv's TMA GEMV launched from the norm (``forward_norm``)."""
    if name == "mlp.gate_up_proj":
        mod.glu_epilogue = False
    if name == "self_attn.qkv_proj":
        mod.tma_preload = False
    mod.forward = partial(_lora_forward, mod, type(mod).forward, slots_a, slots_b)


def _lora_forward(mod, base_forward, slots_a, slots_b, x: torch.Tensor, silu_mul_input: bool = False):
    # (down_proj's LoRA reads silu(gate) * up, as its product does)
    rows = get_forward_context().lora
    if silu_mul_input and rows is not None and rows.mask is not None:   # the torch form: one silu for both
        x, silu_mul_input = silu_and_mul(x), False
    y = base_forward(mod, x, silu_mul_input)    # (y is the product's own: the LoRA rows add in place)
    if rows is None:
        return y
    if rows.mask is None:
        return lora_add_triton(y, x, slots_a, slots_b, rows.slots, silu_mul_input)
    return reference_lora_add(y, x, slots_a, slots_b, rows.mask)
