"""The engine's multimodal pieces. ``ImageInput`` / ``VideoInput``: an image and a video as the
processors make them. ``ImageProcessor``: one PIL image -> the pixel patches and patch
grid a Qwen3.5 vision tower (``models/qwen3_5_vision.py``) reads, exactly as transformers'
``Qwen2VLImageProcessorPil`` (the processor of the Qwen3-VL / Qwen3.5 folders) makes them, so the
embeddings match the checkpoint's training.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

MAX_ASPECT_RATIO = 200


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image (or one frame group of a video) as the model's processor made it."""
    pixel_values: torch.Tensor   # [patches, channels * temporal_patch * patch * patch], float32
    grid_thw: tuple              # (t, h, w) in patches
    num_tokens: int              # its embeddings in the prompt: t * h * w // merge**2
    key: str                     # content hash: equal pixels, equal key
    video: bool = False          # a video's frame group (its placeholder is the video token)

    @classmethod
    def make(cls, pixel_values: torch.Tensor, grid_thw: tuple, merge: int, video: bool = False) -> "ImageInput":
        t, h, w = (int(v) for v in grid_thw)
        digest = hashlib.sha256(pixel_values.contiguous().numpy().tobytes())
        digest.update(repr((t, h, w, video)).encode())
        return cls(pixel_values, (t, h, w), t * h * w // merge ** 2, digest.hexdigest(), video)


@dataclass(frozen=True, eq=False)
class VideoInput:
    """One video as the processor made it: its frame groups in order and each one's time (s)."""
    frames: tuple
    timestamps: tuple


def processor_config(model_path: Optional[str], name: str, hf_config: dict) -> tuple[dict, Optional[dict]]:
    """(the patch sizes of config.json's ``vision_config``, the folder's processor config ``name``
    or None)."""
    vision = hf_config.get("vision_config") or {}
    kw = {ours: vision[theirs] for ours, theirs in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                                                    ("temporal_patch_size", "temporal_patch_size")) if vision.get(theirs)}
    path = Path(model_path) / name if model_path else None
    return kw, json.loads(path.read_text()) if path is not None and path.is_file() else None


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size an image is resized to: both sides multiples of ``factor`` (patch x merge), the
    area within [min_pixels, max_pixels], the aspect ratio kept as near as that allows
    (transformers' ``smart_resize``)."""
    if min(height, width) < 1:
        raise ValueError(f"image of {width}x{height} pixels has no area")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image of {width}x{height} pixels: its aspect ratio "
                         f"{max(height, width) / min(height, width):.1f} is over the {MAX_ASPECT_RATIO} allowed")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def _to_rgb(image):
    """RGB, transparency composited onto white (transformers' ``convert_to_rgb``)."""
    from PIL import Image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


@dataclass(frozen=True)
class ImageProcessor:
    """Defaults: the preprocessor_config.json of the released Qwen3-VL / Qwen3.5 folders (256 x 256
    to 4096 x 4096 pixels, mean and std 0.5), not transformers' Qwen2-VL class defaults."""
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 256 * 256
    max_pixels: int = 4096 * 4096
    image_mean: tuple = (0.5, 0.5, 0.5)
    image_std: tuple = (0.5, 0.5, 0.5)

    @classmethod
    def from_model(cls, model_path: Optional[str], hf_config: dict) -> "ImageProcessor":
        """<model_path>/preprocessor_config.json's values where it has them (top-level
        min_pixels / max_pixels over ``size``'s shortest_edge / longest_edge, as transformers
        reads them), else the patch sizes of config.json's ``vision_config``, else the defaults."""
        kw, pc = processor_config(model_path, "preprocessor_config.json", hf_config)
        if pc is not None:
            size = pc.get("size") or {}
            for ours, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
                value = pc.get(ours) if pc.get(ours) is not None else size.get(edge, size.get(ours))
                if value is not None:
                    kw[ours] = int(value)
            kw.update({k: int(pc[k]) for k in ("patch_size", "temporal_patch_size", "merge_size") if pc.get(k)})
            kw.update({k: tuple(float(v) for v in pc[k]) for k in ("image_mean", "image_std") if pc.get(k)})
        return cls(**kw)

    def num_tokens(self, grid_thw) -> int:
        """The placeholder tokens an image of this patch grid takes (one per merge block)."""
        t, h, w = (int(v) for v in grid_thw)
        return t * h * w // self.merge_size ** 2

    def __call__(self, image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(pixel_values float32 [h * w, 3 * temporal_patch_size * patch_size**2], (1, h, w)): RGB,
        bicubic resize to ``smart_resize``'s size, x / 255, (x - mean) / std, the one frame repeated
        temporal_patch_size times, patches in merge blocks row-major, raster inside each block."""
        from PIL import Image
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        rgb = _to_rgb(image)
        rh, rw = smart_resize(rgb.height, rgb.width, p * m, self.min_pixels, self.max_pixels)
        x = np.asarray(rgb.resize((rw, rh), resample=Image.Resampling.BICUBIC))
        # (float64 rescale, then float32 normalization: transformers' exact arithmetic)
        x = (x.astype(np.float64) * (1 / 255)).astype(np.float32)
        x = (x - np.array(self.image_mean, dtype=np.float32)) / np.array(self.image_std, dtype=np.float32)
        gh, gw = rh // p, rw // p
        patches = torch.from_numpy(np.ascontiguousarray(x)).view(gh // m, m, p, gw // m, m, p, 3)
        patches = patches.permute(0, 3, 1, 4, 6, 2, 5).unsqueeze(5)          # (bh, bw, mh, mw, C, 1, ph, pw)
        patches = patches.expand(*patches.shape[:5], tp, p, p)
        return patches.reshape(gh * gw, 3 * tp * p * p).contiguous(), (1, gh, gw)
