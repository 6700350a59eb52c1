"""Gated delta net (GDN) linear attention, the recurrent token mixer of Qwen3-Next and Qwen3.5.

Per token: one projection gives the conv input (q, k, v channels), the output gate z and the
b, a gate inputs; a depthwise causal conv (kernel ``linear_conv_kernel_dim``) + SiLU over the
q / k / v channels; per-head L2-normalized q and k (q scaled by dk^-0.5 in the rule); beta =
sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule with a recurrent
state [Hv, dk, dv] per sequence (Hv a multiple of Hk: key head i serves value heads
i * Hv / Hk ...); then ``RMSNormGated`` (w * rmsnorm(o) * silu(z)) per value head and out_proj.

The conv and recurrent states live in the runner's state pool; each step's slots come from
``layers/state.py``'s context. Pure decode steps run ``kernels.gdn.post_conv_decode`` (one
launch: conv-state update .. g, beta) and the recurrent rule; other steps the varlen conv and
the chunked rule.

Checkpoint layouts, both packed at load time into one projection ``in_proj`` whose rows are
[q | k | v | z | b | a] (q, k, v, z head-major, contiguous):

- ``qkvz`` (Qwen3-Next): ``in_proj_qkvz`` holds, per key head, [q (dk), k (dk), v (r dv),
  z (r dv)] with r = Hv / Hk, and ``in_proj_ba`` per key head [b (r), a (r)];
- ``qkv`` (Qwen3.5): ``in_proj_qkv`` [q all | k all | v all], ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a``.

``conv1d.weight`` [C, 1, K] has the channels [q | k | v] in both. Tensor parallel: each rank
holds Hk / N key heads and Hv / N value heads (their projection rows, conv channels, A_log,
dt_bias, states and out_proj's input columns); out_proj's output is a partial sum.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .parallel import Part, check_shape, read_block, row_linear, shard_rows
from ..distributed.parallel_state import get_tp_group
from ..kernels import gdn as ops
from .linear import Linear
from .state import copy_rows, get_state_context

LAYOUTS = ("qkvz", "qkv")


class RMSNormGated(nn.Module):
    """w * rmsnorm(x) * silu(z) over the last dim (one value head of dv values)."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm_gated(x, z, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """x [T, hidden] -> [T, hidden] (this rank's partial sum under tensor parallelism)."""

    def __init__(self, hidden: int, num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int,
                 conv_kernel: int, eps: float, layer_idx: int, layout: str):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"GDN projection layout must be one of {LAYOUTS}, got {layout!r}")
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads ({num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({num_k_heads})")
        if conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {conv_kernel}")
        tp = get_tp_group()
        k0, hk = tp.split(num_k_heads, "linear_num_key_heads")
        v0, hv = tp.split(num_v_heads, "linear_num_value_heads")
        self.layer_idx, self.layout = layer_idx, layout
        self.full = (num_k_heads, num_v_heads)
        self.hk, self.dk, self.hv, self.dv = hk, head_k_dim, hv, head_v_dim
        self.k0, self.v0 = k0, v0
        self.conv_dim = 2 * hk * head_k_dim + hv * head_v_dim
        self.in_proj = Linear(hidden, self.conv_dim + hv * head_v_dim + 2 * hv)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(hv))
        self.dt_bias = nn.Parameter(torch.empty(hv))
        if tp.world_size > 1:
            shard_rows(self, Part(0, v0, hv, num_v_heads), "A_log")
            shard_rows(self, Part(0, v0, hv, num_v_heads), "dt_bias")
        self.norm = RMSNormGated(head_v_dim, eps)
        vd = num_v_heads * head_v_dim
        self.out_proj = row_linear(vd, hidden, tp, part=Part(1, v0 * head_v_dim, hv * head_v_dim, vd))

    # ---- shapes of this rank's state -----------------------------------------------------
    @property
    def conv_state_shape(self) -> tuple:
        return (self.conv1d.kernel_size[0] - 1, self.conv_dim)

    @property
    def ssm_state_shape(self) -> tuple:
        return (self.hv, self.dk, self.dv)

    # ---- forward -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(self.in_proj(x))

    def mix(self, proj: torch.Tensor) -> torch.Tensor:
        """The layer after its input projection: proj [T, rows of in_proj] -> [T, hidden]."""
        ctx = get_state_context()
        caches = ctx.caches[self.layer_idx]
        hv, dv, C = self.hv, self.dv, self.conv_dim
        T = proj.shape[0]
        rounds = ctx.rounds
        if len(rounds) == 1 and rounds[0].rows is None:
            o = self._rule(proj, rounds[0], *caches)
        else:  # sequences cut at points whose state is kept: segment by segment
            o = proj.new_empty(T, hv, dv)
            for rnd in rounds:
                o.index_copy_(0, rnd.rows, self._rule(proj.index_select(0, rnd.rows), rnd, *caches))
                if rnd.saves is not None:
                    copy_rows({0: caches}, *rnd.saves)
        z = proj[:, C:C + hv * dv].reshape(T, hv, dv)
        return self.out_proj(self.norm(o, z).reshape(T, hv * dv))

    def _rule(self, proj: torch.Tensor, rnd, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> torch.Tensor:
        """Conv + gated delta rule of one round's tokens (proj rows in the round's order),
        reading and writing the rows' states -> o [T_r, Hv, dv]. (BLITZ_REFERENCE reaches the ops
        through ``kernels._common.reference_ops``.)"""
        hk, dk, hv, dv, C = self.hk, self.dk, self.hv, self.dv, self.conv_dim
        mixed = proj[:, :C]
        b = proj[:, C + hv * dv:C + hv * dv + hv]
        a = proj[:, C + hv * dv + hv:]
        weight = self.conv1d.weight.squeeze(1)
        if rnd.pure_decode:
            q, k, v, g, beta = ops.post_conv_decode(mixed, a, b, conv_state, rnd.slots, weight, None, self.A_log,
                                                    self.dt_bias, hk, dk, hv, dv, dst_slots=rnd.dst)
            return ops.gated_delta_rule_decode(q, k, v, g, beta, ssm_state, rnd.slots, dst_slots=rnd.dst)
        y = ops.causal_conv1d_prefill(mixed, weight, None, conv_state, rnd.slots, rnd.has_initial, rnd.cu_seqlens,
                                      rnd.host)
        q, k, v = ops.split_qkv(y, hk, dk, hv, dv)
        g, beta = ops.gdn_gates(a, b, self.A_log, self.dt_bias)
        return ops.gated_delta_rule_prefill(q, k, v, g, beta, ssm_state, rnd.slots, rnd.has_initial, rnd.cu_seqlens,
                                            rnd.host[2])

    # ---- checkpoint ----------------------------------------------------------------------
    def _row_maps(self) -> dict:
        """checkpoint sub-name -> (its rows, [(checkpoint row, our row, count)]) for in_proj
        and conv1d (see the module docstring)."""
        (HK, HV), dk, dv = self.full, self.dk, self.dv
        hk, hv, k0, v0 = self.hk, self.hv, self.k0, self.v0
        Q, V, C = hk * dk, hv * dv, self.conv_dim
        qkv = [(k0 * dk, 0, Q), (HK * dk + k0 * dk, Q, Q), (2 * HK * dk + v0 * dv, 2 * Q, V)]
        maps = {"conv1d.weight": (2 * HK * dk + HV * dv, qkv)}
        if self.layout == "qkv":
            maps.update({"in_proj_qkv.weight": (2 * HK * dk + HV * dv, qkv),
                         "in_proj_z.weight": (HV * dv, [(v0 * dv, C, V)]),
                         "in_proj_b.weight": (HV, [(v0, C + V, hv)]),
                         "in_proj_a.weight": (HV, [(v0, C + V + hv, hv)])})
            return maps
        r = HV // HK
        group = 2 * dk + 2 * r * dv
        qkvz, ba = [], []
        for j in range(hk):
            s = (k0 + j) * group
            qkvz += [(s, j * dk, dk), (s + dk, Q + j * dk, dk), (s + 2 * dk, 2 * Q + j * r * dv, r * dv),
                     (s + 2 * dk + r * dv, C + j * r * dv, r * dv)]
            ba += [((k0 + j) * 2 * r, C + V + j * r, r), ((k0 + j) * 2 * r + r, C + V + hv + j * r, r)]
        maps.update({"in_proj_qkvz.weight": (2 * HK * dk + 2 * HV * dv, qkvz), "in_proj_ba.weight": (2 * HV, ba)})
        return maps

    def load_checkpoint(self, sub: str, tensor, name: str) -> Optional[list]:
        """Copy checkpoint tensor ``name`` (``sub`` relative to this layer) into in_proj or
        conv1d, this rank's rows where they belong; returns the load keys it filled, None for
        the tensors the loader copies as they are."""
        maps = self._row_maps()
        if sub not in maps:
            return None
        rows, segments = maps[sub]
        dst = self.conv1d.weight if sub == "conv1d.weight" else self.in_proj.weight
        check_shape(tensor, (rows, *dst.shape[1:]), name)
        with torch.no_grad():
            for src, at, n in segments:
                dst[at:at + n].copy_(read_block(tensor, [slice(src, src + n)]))
        return [name]

    def required_keys(self, prefix: str) -> list:
        """The checkpoint names that fill ``<prefix>.in_proj.weight``."""
        return [f"{prefix}.{sub}" for sub in self._row_maps() if sub.startswith("in_proj_")]
