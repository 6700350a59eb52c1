"""Videos for a model with a vision tower (multimodal Qwen3.5): a clip in, what the engine
attaches to a prompt out.

``Video`` is a clip as a client gives it: RGB frames, the source's frame rate, and, when the
frames were sampled already (a decoder that kept a few), their indices in the source.
``VideoProcessor`` is transformers' ``Qwen3VLVideoProcessor`` (the processor of the Qwen3.5
folders) as defined: frames sampled uniformly at ``fps`` per second of the source (at least
``min_frames``, at most ``max_frames``), resized with torchvision's tensor resize (bicubic,
antialiased, rounded back to bytes) to a size whose area summed over the frames lies within
the pixel bounds, normalized, padded to whole temporal patches with the last frame, and cut
into patches. Each temporal patch (two frames) becomes one ``ImageInput`` of grid (1, h, w): the
tower attends within a frame group and repeats its positions per group, so a group's
embeddings do not depend on the others. In the prompt each group follows its time, the mean of
its frames' times: ``<0.5 seconds><|vision_start|><|video_pad|> x n<|vision_end|>``
(``images.expand_videos``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from .multimodal import ImageInput, VideoInput, processor_config

DEFAULT_SOURCE_FPS = 24.0   # transformers' assumption for frames that come without a frame rate


@dataclass(frozen=True, eq=False)
class Video:
    """frames: uint8 [T, H, W, 3] RGB; fps: the source's frames per second (None: unknown);
    frames_indices: these frames' indices in the source when they were sampled already (then
    they are taken as they are), else None (the processor samples them)."""
    frames: np.ndarray
    fps: Optional[float] = None
    frames_indices: Optional[tuple] = None


def as_video(value) -> Video:
    """vLLM's video items -> a ``Video``: a [T, H, W, 3] uint8 array or tensor, a list of PIL images
    or of [H, W, 3] arrays, or a tuple (one of those, metadata) where metadata is a dict with
    ``fps`` and, for frames sampled already, ``frames_indices``."""
    if isinstance(value, Video):
        return value
    meta = {}
    if isinstance(value, tuple):
        if len(value) != 2 or not isinstance(value[1], dict):
            raise ValueError("a video tuple must be (frames, metadata dict)")
        value, meta = value
    if isinstance(value, torch.Tensor):
        value = value.cpu().numpy()
    if isinstance(value, (list, tuple)):
        from PIL import Image
        value = [np.asarray(f.convert("RGB")) if isinstance(f, Image.Image) else np.asarray(f) for f in value]
        if not value or len({f.shape for f in value}) != 1:
            raise ValueError("a video's frames must be a non-empty list of images of one size")
        value = np.stack(value)
    if not isinstance(value, np.ndarray) or value.ndim != 4 or value.shape[-1] != 3 or value.dtype != np.uint8:
        shape = getattr(value, "shape", None)
        raise ValueError("a video must be uint8 RGB frames [frames, height, width, 3] (an array, a tensor or a list "
                         f"of PIL images), optionally as (frames, {{'fps': ...}}); got {type(value).__name__} {shape}")
    if min(value.shape[:3]) < 1:
        raise ValueError(f"a video of shape {tuple(value.shape)} has no frames or no pixels")
    fps = meta.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
        raise ValueError(f"a video's fps must be a positive number, got {fps!r}")
    idx = meta.get("frames_indices")
    if idx is not None:
        idx = tuple(int(i) for i in idx)
        if len(idx) != value.shape[0]:
            raise ValueError(f"frames_indices has {len(idx)} entries for {value.shape[0]} frames")
    return Video(value, None if fps is None else float(fps), idx)


def videos_of(value) -> list:
    """``multi_modal_data["video"]`` -> its videos: one video item, or a list of them (a list of
    frames, PIL images or [H, W, 3] arrays, is one video, as in vLLM)."""
    if isinstance(value, list) and value and all(
            isinstance(v, (Video, tuple, list)) or getattr(v, "ndim", 0) == 4 for v in value):
        return value
    return [value]


def smart_resize_video(frames: int, height: int, width: int, temporal: int, factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """A frame's size after resizing: sides multiples of ``factor``, the area of all frames
    (rounded to whole temporal patches) within [min_pixels, max_pixels] (transformers' video
    ``smart_resize``)."""
    if frames < temporal:
        raise ValueError(f"a video needs at least {temporal} frames after sampling, got {frames}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"video frames of {width}x{height}: the aspect ratio is over 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(frames / temporal) * temporal
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class VideoProcessor:
    """Defaults: transformers' Qwen3VLVideoProcessor class values; a folder's
    video_preprocessor_config.json overrides them (``from_model``)."""
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 768 * 32 * 32
    image_mean: tuple = (0.5, 0.5, 0.5)
    image_std: tuple = (0.5, 0.5, 0.5)
    fps: float = 2.0
    num_frames: Optional[int] = None   # a fixed frame count in place of fps
    min_frames: int = 4
    max_frames: int = 768

    @classmethod
    def from_model(cls, model_path: Optional[str], hf_config: dict) -> "VideoProcessor":
        kw, pc = processor_config(model_path, "video_preprocessor_config.json", hf_config)
        if pc is not None:
            size = pc.get("size") or {}
            for ours, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
                if size.get(edge) is not None:
                    kw[ours] = int(size[edge])
            kw.update({k: int(pc[k]) for k in ("patch_size", "temporal_patch_size", "merge_size", "min_frames",
                                               "max_frames", "num_frames") if pc.get(k)})
            kw.update({k: tuple(float(v) for v in pc[k]) for k in ("image_mean", "image_std") if pc.get(k)})
            if pc.get("fps"):
                kw["fps"] = float(pc["fps"])
        return cls(**kw)

    def indices(self, total: int, fps: Optional[float]) -> list:
        """The indices of the frames sampled from a source of ``total`` frames at ``fps`` (None:
        unknown): ``self.fps`` a second, or ``num_frames``, spread evenly (transformers' sample_frames)."""
        n = self.num_frames
        if n is None:
            n = int(total / (fps or DEFAULT_SOURCE_FPS) * self.fps)
            n = min(max(n, self.min_frames), self.max_frames, total)
        return np.linspace(0, total - 1, n).round().astype(int).tolist()

    def sample(self, video: Video) -> tuple[np.ndarray, list]:
        """(the frames kept, their indices in the source)."""
        if video.frames_indices is not None:
            return video.frames, list(video.frames_indices)
        idx = self.indices(video.frames.shape[0], video.fps)
        return video.frames[idx], idx

    def timestamps(self, indices: list, fps: Optional[float]) -> list:
        """Each temporal patch's time in seconds: the mean of its first and last frame's (the last
        frame repeated to fill the final patch)."""
        tp, fps = self.temporal_patch_size, fps or DEFAULT_SOURCE_FPS
        idx = list(indices) + [indices[-1]] * (-len(indices) % tp)
        return [(idx[i] / fps + idx[i + tp - 1] / fps) / 2 for i in range(0, len(idx), tp)]

    def __call__(self, video: Video) -> VideoInput:
        frames, indices = self.sample(video)
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)     # [T, 3, H, W] uint8
        rh, rw = smart_resize_video(x.shape[0], x.shape[2], x.shape[3], tp, p * m, self.min_pixels, self.max_pixels)
        if (rh, rw) != tuple(x.shape[2:]):
            # torchvision's resize of a uint8 tensor: float32, antialiased bicubic, clamped and rounded
            x = F.interpolate(x.float(), size=(rh, rw), mode="bicubic", align_corners=False, antialias=True)
            x = x.clamp_(0, 255).round_().to(torch.uint8)
        mean = torch.tensor(self.image_mean).view(1, 3, 1, 1) * 255   # (rescale folded into mean and std)
        std = torch.tensor(self.image_std).view(1, 3, 1, 1) * 255
        x = (x.float() - mean) / std
        if pad := -x.shape[0] % tp:
            x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
        gt, gh, gw = x.shape[0] // tp, rh // p, rw // p
        x = x.reshape(gt, tp, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        x = x.reshape(gt, gh * gw, 3 * tp * p * p)     # merge blocks row-major, raster inside, per group
        groups = tuple(ImageInput.make(x[g].contiguous(), (1, gh, gw), m, video=True) for g in range(gt))
        return VideoInput(groups, tuple(self.timestamps(indices, video.fps)))
