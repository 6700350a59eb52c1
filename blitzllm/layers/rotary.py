"""Rotary position embedding (neox / rotate-half layout, as HF Llama and Qwen): builds
``cos_sin_cache [max_positions, rotary_dim]`` (cos, then sin), the layout the Triton kernels
read too. Scaling: default, linear, llama3, yarn (its attention factor scales cos and sin).
"""
from __future__ import annotations

import math

import torch
from torch import nn


def _rope_kind(scaling: dict | None):
    return scaling.get("rope_type", scaling.get("type")) if scaling else None


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``scale`` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rotary_dim: int, base: float, scaling: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_factor) as transformers' ``_compute_yarn_parameters``, in float32: the
    frequencies blend from extrapolated (high dims kept) to interpolated (divided by ``factor``)
    over a linear ramp between the beta_fast and beta_slow correction dims."""
    old_len = scaling.get("original_max_position_embeddings") or max_positions
    factor = scaling.get("factor") or max_positions / old_len
    attn = scaling.get("attention_factor")
    if attn is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            attn = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attn = yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return rotary_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    keep = 1 - ramp  # 1: extrapolate (high-frequency dims), 0: interpolate
    inv = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv.double(), float(attn)


def _inv_freq(rotary_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """Default, linear or llama3 frequencies (YaRN's: ``_yarn``)."""
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if not scaling:
        return inv
    kind = _rope_kind(scaling)
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wl, high_wl = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > low_wl, inv / factor, inv)
        is_mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        return torch.where(is_mid, mid, out)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3, yarn")


def build_cos_sin_cache(rotary_dim: int, max_positions: int, base: float,
                        scaling: dict | None = None) -> torch.Tensor:
    # float32 like HF, so positions round the same way as the oracle
    if _rope_kind(scaling) == "yarn":
        inv, attn = _yarn(rotary_dim, base, scaling, max_positions)
    else:
        inv, attn = _inv_freq(rotary_dim, base, scaling), 1.0
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv.float())
    cos, sin = freqs.cos(), freqs.sin()
    if attn != 1.0:
        cos, sin = cos * attn, sin * attn
    return torch.cat([cos, sin], dim=-1)


def apply_rotary_torch(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; rotates the first rotary_dim dims of every head."""
    rot = cos_sin.shape[-1]
    cs = cos_sin.index_select(0, positions)
    cos, sin = cs[:, None, : rot // 2], cs[:, None, rot // 2:]
    xr = x[..., :rot].float()
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    if rot == x.shape[-1]:
        return out
    return torch.cat([out, x[..., rot:]], dim=-1)


def mrope_rows(cos_sin: torch.Tensor, positions: torch.Tensor, section: tuple) -> torch.Tensor:
    """Interleaved M-RoPE (Qwen3-VL, Qwen3.5): [T, rotary_dim] cos/sin rows for positions [3, T]
    (time, height, width). Frequency i turns with the height position where i % 3 == 1 and
    i < 3 * section[1], with the width position where i % 3 == 2 and i < 3 * section[2], else
    with time; a row is gathered from the one-position table, so values equal the 1-D rows
    where the three positions are equal (text)."""
    half = cos_sin.shape[-1] // 2
    i = torch.arange(half, device=positions.device)
    axis = torch.zeros(half, dtype=torch.int64, device=positions.device)
    axis[(i % 3 == 1) & (i < 3 * section[1])] = 1
    axis[(i % 3 == 2) & (i < 3 * section[2])] = 2
    idx = positions[axis].T                         # [T, half]: each frequency's position
    return torch.cat([cos_sin[:, :half].gather(0, idx), cos_sin[:, half:].gather(0, idx)], -1)


def rotary_tables(cos_sin: torch.Tensor, positions: torch.Tensor):
    """Per-step tables for ``apply_rotary_tables``: (cos, sin), each [T, 1, rotary_dim]
    float32 with the half repeated (sin negated in its first half, the rotate-half sign)."""
    half = cos_sin.shape[-1] // 2
    cs = cos_sin.index_select(0, positions)
    c, s = cs[:, :half], cs[:, half:]
    return torch.cat([c, c], -1)[:, None], torch.cat([-s, s], -1)[:, None]


def apply_rotary_tables(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Same values as ``apply_rotary_torch`` (x1*c - x2*s, x2*c + x1*s, each rounded once)
    in four tensor ops: x*cos + swap_halves(x)*sin_signed."""
    rot = cos.shape[-1]
    xf = x.float()
    if rot != x.shape[-1]:
        return torch.cat([apply_rotary_tables(xf[..., :rot], cos, sin_signed), xf[..., rot:]], -1).to(x.dtype)
    half = rot // 2
    return (xf * cos + torch.cat([xf[..., half:], xf[..., :half]], -1) * sin_signed).to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, max_positions: int, base: float, scaling: dict | None = None):
        super().__init__()
        self.rotary_dim = rotary_dim
        if torch.get_default_device().type == "meta":
            # runner/build.py rebuilds the table after to_empty; a meta arange would import
            # torch._dynamo (1.6 s of every start-up) for nothing
            table = torch.empty(max_positions, rotary_dim)
        else:
            table = build_cos_sin_cache(rotary_dim, max_positions, base, scaling)
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def forward(self, positions, q, k):
        return (apply_rotary_torch(q, positions, self.cos_sin_cache),
                apply_rotary_torch(k, positions, self.cos_sin_cache))
