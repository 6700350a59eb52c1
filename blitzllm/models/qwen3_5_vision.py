"""The vision tower of the multimodal Qwen3.5 checkpoints (``model.visual.*``): image patches in,
the merged embeddings the text model reads at an image's placeholder tokens out.

A patch embedding (the checkpoint's Conv3d, kernel = stride, run as one matmul), a learned square
position table resampled bilinearly (align_corners) to each image's patch grid, ``depth``
pre-LayerNorm blocks of bidirectional attention inside each frame with 2-D rotary (the h and w
coordinates each rotating a quarter of a head, in float32), then the merger: LayerNorm, each
``merge x merge`` block of patches concatenated, a GELU MLP to the text model's hidden size.

Patches come in the image processor's order (``engine/multimodal.py``): merge blocks row-major,
raster inside each block. The modules are torch's own (nn.Linear, nn.LayerNorm, nn.Conv3d), whole
on every tensor-parallel rank, so the decode plan, weight quantization and LoRA (which act on
``layers.linear.Linear``) leave them alone. Facts from transformers' ``Qwen3_5VisionModel``.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

# transformers' Qwen3_5VisionConfig defaults, for keys a config.json leaves out
DEFAULTS = dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304, num_heads=16,
                in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584,
                num_position_embeddings=2304)

_ACT = {"gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"), "gelu": F.gelu, "silu": F.silu,
        "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str):
        super().__init__()
        if act not in _ACT:
            raise ValueError(f"vision_config hidden_act {act!r} is not one of {sorted(_ACT)}")
        self.linear_fc1, self.linear_fc2, self.act = nn.Linear(hidden, inter), nn.Linear(inter, hidden), _ACT[act]

    def forward(self, x):
        return self.linear_fc2(self.act(self.linear_fc1(x)))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on the whole head (rotate-half layout) in float32, rounded back to x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x, cos, sin, seqlens: list):
        """``seqlens``: the frames' patch counts in order; each attends only within itself."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        outs = [F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1))
                for qs, ks, vs in zip(q.split(seqlens), k.split(seqlens), v.split(seqlens))]
        return self.proj(torch.cat(outs, dim=1).transpose(0, 1).reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        h = c["hidden_size"]
        self.norm1, self.norm2 = nn.LayerNorm(h, eps=1e-6), nn.LayerNorm(h, eps=1e-6)
        self.attn = VisionAttention(h, c["num_heads"])
        self.mlp = VisionMLP(h, c["intermediate_size"], c["hidden_act"])

    def forward(self, x, cos, sin, seqlens):
        x = x + self.attn(self.norm1(x), cos, sin, seqlens)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        kernel = (c["temporal_patch_size"], c["patch_size"], c["patch_size"])
        self.proj = nn.Conv3d(c["in_channels"], c["hidden_size"], kernel, stride=kernel, bias=True)

    def forward(self, x):
        """A kernel-sized, stride-sized Conv3d over one patch is a matmul over its flattened pixels."""
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class PatchMerger(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        h, self.merged = c["hidden_size"], c["hidden_size"] * c["spatial_merge_size"] ** 2
        self.norm = nn.LayerNorm(h, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, c["out_hidden_size"])

    def forward(self, x):
        """A merge block's patches are consecutive: a view concatenates them."""
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).view(-1, self.merged))))


def _block_coords(h: int, w: int, m: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each patch of an h x w grid in the processor's order: ``m x m`` blocks row-major,
    raster inside each block."""
    rows = torch.arange(h, device=device).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
    cols = torch.arange(w, device=device).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
    return rows.permute(0, 2, 1, 3).flatten(), cols.permute(0, 2, 1, 3).flatten()


def _bilinear_taps(idx: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table rows an axis position reads (align_corners: the grid's ends on the table's
    ends) and their weights, float32."""
    src = idx.float() * (side - 1) / max(size - 1, 1)
    lo = src.floor()
    frac = src - lo
    taps = (lo.long()[:, None] + torch.arange(2, device=idx.device)).clamp(0, side - 1)
    return taps, torch.stack((1 - frac, frac), dim=-1)


class Qwen3_5VisionTower(nn.Module):
    """``model.visual`` of a Qwen3.5 multimodal checkpoint, its parameter names without that prefix."""

    def __init__(self, vision_cfg: dict):
        super().__init__()
        c = {**DEFAULTS, **{k: v for k, v in vision_cfg.items() if v is not None}}
        self.merge = c["spatial_merge_size"]
        self.head_dim = c["hidden_size"] // c["num_heads"]
        rope = c.get("rope_parameters") or {}
        self.rope_theta = float(rope.get("rope_theta") or c.get("rope_theta") or 10000.0)
        self.side = int(c["num_position_embeddings"] ** 0.5)
        self.patch_embed = PatchEmbed(c)
        self.pos_embed = nn.Embedding(c["num_position_embeddings"], c["hidden_size"])
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c["depth"]))
        self.merger = PatchMerger(c)

    def _positions(self, grid: list, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Every patch's (row, col), each frame of an image repeating its grid."""
        coords = [_block_coords(h, w, self.merge, device) for _, h, w in grid]
        rows = torch.cat([r.repeat(t) for (t, _, _), (r, _) in zip(grid, coords)])
        cols = torch.cat([c.repeat(t) for (t, _, _), (_, c) in zip(grid, coords)])
        return rows, cols

    def _pos_embeds(self, grid: list, rows, cols) -> torch.Tensor:
        """The position table resampled to each image's grid: four taps per patch, float32 weights."""
        counts = [t * h * w for t, h, w in grid]
        hs = [_bilinear_taps(r, h, self.side) for (_, h, _), r in zip(grid, rows.split(counts))]
        ws = [_bilinear_taps(c, w, self.side) for (_, _, w), c in zip(grid, cols.split(counts))]
        (ht, hw), (wt, ww) = [[torch.cat(x) for x in zip(*axis)] for axis in (hs, ws)]
        idx = (ht[:, :, None] * self.side + wt[:, None, :]).flatten(1)
        wts = (hw[:, :, None] * ww[:, None, :]).flatten(1)
        return (self.pos_embed(idx) * wts[..., None]).sum(1)

    def _rotary(self, rows, cols) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, 1, head_dim]: the row angles on a quarter of the head, the column
        angles on the next, both halves of the rotate-half layout alike."""
        half = self.head_dim // 2
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float, device=rows.device)
                                              / half))
        ang = torch.cat((rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq), dim=-1)
        ang = torch.cat((ang, ang), dim=-1)[:, None, :]
        return ang.cos(), ang.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [patches, C * T * P * P] of the images in order, grid_thw [images, 3] ->
        [patches // merge**2, out_hidden_size]."""
        grid = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        x = self.patch_embed(pixel_values)
        rows, cols = self._positions(grid, x.device)
        x = x + self._pos_embeds(grid, rows, cols).to(x.dtype)
        cos, sin = self._rotary(rows, cols)
        seqlens = [h * w for t, h, w in grid for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, seqlens)
        return self.merger(x)
