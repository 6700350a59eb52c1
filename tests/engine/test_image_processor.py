"""engine/multimodal.py's ImageProcessor against transformers' Qwen2VLImageProcessorPil (the
processor of the Qwen3.5 folders): the same pixel values and patch grid for RGB, RGBA (composited
onto white), grayscale and palette images, upscaled, downscaled and kept; its settings from a
folder's preprocessor_config.json or config.json's vision_config; the aspect-ratio error."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from blitzllm.engine.multimodal import ImageProcessor, smart_resize


def _hf_processor(p: ImageProcessor):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(patch_size=p.patch_size, temporal_patch_size=p.temporal_patch_size,
                                    merge_size=p.merge_size, image_mean=list(p.image_mean),
                                    image_std=list(p.image_std),
                                    size={"shortest_edge": p.min_pixels, "longest_edge": p.max_pixels})


def _image(mode: str, width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "P": 3}[mode]
    arr = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    img = Image.fromarray(arr[..., 0] if channels == 1 else arr)
    return img.convert("P") if mode == "P" else img


def _assert_same(ours: ImageProcessor, img: Image.Image) -> tuple:
    px, grid = ours(img)
    ref = _hf_processor(ours)(img, return_tensors="pt")
    assert grid == tuple(ref["image_grid_thw"][0].tolist())
    assert px.dtype == torch.float32 and px.shape == ref["pixel_values"].shape
    torch.testing.assert_close(px, ref["pixel_values"].float(), atol=1e-5, rtol=0)
    return grid


@pytest.mark.parametrize("mode,width,height", [
    ("RGB", 300, 200),     # kept near its size (rounded to the 32-pixel grid)
    ("RGBA", 37, 21),      # tiny: upscaled to min_pixels
    ("L", 512, 700),
    ("P", 120, 90),        # palette: converted to RGB
    ("RGB", 2, 150),       # extreme aspect ratio, still allowed
])
def test_matches_transformers_with_the_qwen3_5_defaults(mode, width, height):
    p = ImageProcessor()
    grid = _assert_same(p, _image(mode, width, height, seed=width))
    t, h, w = grid
    assert t == 1 and h * w * 16 * 16 >= p.min_pixels
    assert p.num_tokens(grid) == h * w // 4


def test_downscaled_to_max_pixels_and_other_patch_sizes():
    """A small max_pixels forces the downscale branch; patch 14 (Qwen2-VL's) and CLIP's mean/std."""
    p = ImageProcessor(patch_size=14, min_pixels=56 * 56, max_pixels=28 * 28 * 40,
                       image_mean=(0.48145466, 0.4578275, 0.40821073), image_std=(0.26862954, 0.26130258, 0.27577711))
    grid = _assert_same(p, _image("RGB", 640, 480, seed=1))
    assert grid[1] * grid[2] * 14 * 14 <= p.max_pixels
    _assert_same(p, _image("RGBA", 1000, 333, seed=2))


def test_transparent_pixels_become_white():
    img = Image.new("RGBA", (64, 64), (10, 20, 30, 0))
    px, _ = ImageProcessor(min_pixels=32 * 32)(img)
    torch.testing.assert_close(px, torch.ones_like(px))   # (1 - 0.5) / 0.5


def test_settings_from_preprocessor_config(tmp_path):
    vision = {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    assert ImageProcessor.from_model(None, {}) == ImageProcessor()
    assert ImageProcessor.from_model(str(tmp_path), {"vision_config": vision}) == ImageProcessor(patch_size=14)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 4096, "longest_edge": 200000}, "patch_size": 16, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.3, 0.4]}))
    p = ImageProcessor.from_model(str(tmp_path), {"vision_config": vision})
    assert p == ImageProcessor(min_pixels=4096, max_pixels=200000, image_mean=(0.5, 0.4, 0.3),
                               image_std=(0.2, 0.3, 0.4))
    _assert_same(p, _image("RGB", 900, 700, seed=3))
    # top-level min_pixels / max_pixels win over size, as in transformers' processor
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 4096, "longest_edge": 200000}, "min_pixels": 3136, "max_pixels": 50176}))
    p = ImageProcessor.from_model(str(tmp_path), {"vision_config": vision})
    assert (p.min_pixels, p.max_pixels, p.patch_size) == (3136, 50176, 14)
    _assert_same(p, _image("RGB", 400, 260, seed=4))


def test_aspect_ratio_over_200_is_refused():
    with pytest.raises(ValueError, match="aspect ratio"):
        ImageProcessor()(_image("RGB", 402, 2, seed=5))
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 201, 32, 256 * 256, 4096 * 4096)
    assert smart_resize(1, 200, 32, 256 * 256, 4096 * 4096)[0] >= 32
