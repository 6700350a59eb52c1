"""The vision tower of a multimodal Qwen3.5 folder (models/qwen3_5_vision.py, loaded by
models/qwen3_next.py as ``visual``): a tiny random ``qwen3_5_moe`` checkpoint written by
transformers loads through our loader, and ``embed_images`` of two images of different sizes
(pixel values from engine/multimodal.py's ImageProcessor) equals transformers'
``get_image_features``; the tower's parameters carry the checkpoint's names; weight_dtype='fp8'
leaves it alone; bf16 runs in bf16; a config without vision_config loads no tower."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from blitzllm.config import ModelConfig
from blitzllm.engine.multimodal import ImageProcessor
from blitzllm.loader.source import resolve_model
from blitzllm.runner.build import build_model

from tests.models.test_qwen3_next import VISION, make_hybrid_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The folder (with a preprocessor_config.json keeping the images small), transformers' model."""
    path = tmp_path_factory.mktemp("qwen3_5_moe_vision")
    hf = make_hybrid_checkpoint("qwen3_5_moe", path, seed=7)
    with torch.no_grad():  # (biases and norms away from their init, so a misplaced one shows)
        for name, t in hf.model.visual.state_dict().items():
            if "norm" in name or "bias" in name:
                t.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.3)
    hf.save_pretrained(str(path), safe_serialization=True)
    (path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 16 * 16, "max_pixels": 64 * 64}))
    return path, hf


def _build(path, dtype=torch.float32, weight_dtype=None):
    src = resolve_model(str(path))
    cfg = ModelConfig.from_hf(src.hf_config)
    return build_model(src, cfg, torch.device("cpu"), dtype, 0, weight_dtype), src


def _images(path, hf_config):
    """Two random images of different sizes and modes through our ImageProcessor."""
    proc = ImageProcessor.from_model(str(path), hf_config)
    assert (proc.patch_size, proc.merge_size, proc.max_pixels) == (VISION["patch_size"], 2, 64 * 64)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (23, 41, 3), dtype=np.uint8)),
              Image.fromarray(rng.integers(0, 256, (90, 57, 4), dtype=np.uint8))]
    out = [proc(img) for img in images]
    grid = torch.tensor([g for _, g in out])
    assert grid[0].tolist() != grid[1].tolist()
    return torch.cat([px for px, _ in out]), grid, proc


def _reference(hf, pixel_values, grid):
    with torch.no_grad():
        return torch.cat(hf.model.get_image_features(pixel_values, grid).pooler_output)


def test_embed_images_matches_transformers(checkpoint):
    path, hf = checkpoint
    model, src = _build(path)
    pixel_values, grid, proc = _images(path, src.hf_config)
    with torch.no_grad():
        ours = model.embed_images(pixel_values, grid)
    ref = _reference(hf, pixel_values, grid)
    assert ours.shape == (sum(proc.num_tokens(g) for g in grid.tolist()), VISION["out_hidden_size"])
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    # per image as well: images never attend to each other
    with torch.no_grad():
        first = model.embed_images(pixel_values[:int(grid[0].prod())], grid[:1])
    torch.testing.assert_close(first, ref[:len(first)], atol=1e-5, rtol=1e-5)
    assert (model.image_token_id, model.vision_start_token_id, model.spatial_merge_size) == (
        hf.config.image_token_id, hf.config.vision_start_token_id, VISION["spatial_merge_size"])


def test_tower_names_are_the_checkpoints(checkpoint):
    """``visual``'s state dict is the checkpoint's ``model.visual.*`` less the prefix: a
    ``load_state_dict`` of transformers' tower fits it exactly."""
    path, hf = checkpoint
    model, _ = _build(path)
    theirs = hf.model.visual.state_dict()
    assert set(model.visual.state_dict()) == set(theirs)
    for name, t in model.visual.state_dict().items():
        torch.testing.assert_close(t, theirs[name], atol=0, rtol=0)
    model.visual.load_state_dict(theirs, strict=True)


def test_fp8_weights_leave_the_tower_whole(checkpoint):
    """weight_dtype='fp8' quantizes the text model's linears only: the tower keeps its fp32
    weights and its embeddings."""
    path, hf = checkpoint
    model, src = _build(path, weight_dtype="fp8")
    assert model.model.layers[1].self_attn.o_proj.fp8_block is not None
    assert all(p.dtype == torch.float32 for p in model.visual.parameters())
    pixel_values, grid, _ = _images(path, src.hf_config)
    with torch.no_grad():
        ours = model.embed_images(pixel_values, grid)
    torch.testing.assert_close(ours, _reference(hf, pixel_values, grid), atol=1e-5, rtol=1e-5)


def test_bf16_runs_in_the_weights_dtype(checkpoint):
    path, hf = checkpoint
    model, src = _build(path, dtype=torch.bfloat16)
    pixel_values, grid, _ = _images(path, src.hf_config)
    with torch.no_grad():
        ours = model.embed_images(pixel_values, grid)   # (float32 pixels cast to the tower's dtype)
    assert ours.dtype == torch.bfloat16
    ref = _reference(hf, pixel_values, grid)
    assert (ours.float() - ref).abs().max() < 0.05 * ref.abs().max()


def test_text_only_folder_has_no_tower(checkpoint, tmp_path):
    """A multimodal config without vision_config loads its text model only (as before) and
    embed_images says why it cannot run."""
    path, _ = checkpoint
    cfg = json.loads((path / "config.json").read_text())
    del cfg["vision_config"]
    for f in path.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model, _ = _build(tmp_path)
    assert model.visual is None and model.spatial_merge_size is None
    assert not any(n.startswith("visual.") for n, _ in model.named_parameters())
    with pytest.raises(ValueError, match="no vision tower"):
        model.embed_images(torch.zeros(4, 96), torch.tensor([[1, 2, 2]]))


def test_tensor_parallel_rank_holds_the_whole_tower(checkpoint):
    """With tensor_parallel_size=2 the tower is not split: rank 0's embeddings are transformers'."""
    from blitzllm import LLM
    path, hf = checkpoint
    pixel_values, grid, _ = _images(path, json.loads((path / "config.json").read_text()))
    with LLM(str(path), device="cpu", dtype="float32", kv_cache_blocks=16, tensor_parallel_size=2) as llm:
        model = llm.engine.runner.model
        assert model.model.layers[1].self_attn.o_proj.weight.shape[1] < hf.config.text_config.hidden_size
        with torch.no_grad():
            ours = model.embed_images(pixel_values, grid)
    torch.testing.assert_close(ours, _reference(hf, pixel_values, grid), atol=1e-5, rtol=1e-5)
