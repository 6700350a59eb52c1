"""Images in a prompt (engine/images.py) against transformers' Qwen3.5 definitions: the
placeholder expansion and M-RoPE positions of ``get_rope_index``, the interleaved M-RoPE
cos/sin rows of ``Qwen3_5TextRotaryEmbedding``, the prefix cache's view of image tokens, and
the errors a request with mismatched placeholders gets."""
import pytest
import torch

from blitzllm.engine.images import ImageInput, VideoInput, VisionTokens, attach_images, expand_videos
from blitzllm.layers.rotary import build_cos_sin_cache, mrope_rows

IMG, VID, START, END = 7, 8, 9, 10   # the image, video and start / end tokens of these prompts
TOKENS = VisionTokens(IMG, VID, START, END)


def _image(t, h, w, seed=0, merge=2):
    g = torch.Generator().manual_seed(seed)
    return ImageInput.make(torch.randn(t * h * w, 12, generator=g), (t, h, w), merge)


def _hf_rope_index(ids, grids, video_grids=None):
    """transformers' Qwen3_5Model.get_rope_index on one prompt (the method reads only its config)."""
    import transformers
    cfg = transformers.Qwen3_5Config(vision_config=dict(spatial_merge_size=2))
    fake = type("M", (), {"config": cfg})()
    model_cls = transformers.Qwen3_5Model
    fake.get_vision_position_ids = model_cls.get_vision_position_ids.__get__(fake)
    ids_t = torch.tensor([ids])
    types = (ids_t == IMG).int() + 2 * (ids_t == VID).int()
    return model_cls.get_rope_index(fake, ids_t, types, image_grid_thw=torch.tensor(grids) if grids else None,
                                    video_grid_thw=None if video_grids is None else torch.tensor(video_grids))


def test_positions_match_get_rope_index():
    """Two images (4x6 and 8x4 patch grids, merge 2) among text: the expanded prompt, each token's
    three positions and the delta past the prompt equal transformers'; text tokens have three equal
    positions and the prefix cache sees each image token as (image key, index)."""
    a, b = _image(1, 4, 6, 0), _image(1, 8, 4, 1)
    ids = [1, 2, IMG, 3, 4, 5, IMG, 6]
    out, pi = attach_images(ids, [a, b], TOKENS, 2)
    assert out == [1, 2] + [IMG] * 6 + [3, 4, 5] + [IMG] * 8 + [6]
    assert pi.offsets == [2, 11] and [im.num_tokens for im in pi.images] == [6, 8]
    ref, delta = _hf_rope_index(out, [list(a.grid_thw), list(b.grid_thw)])
    assert torch.equal(pi.positions, ref[:, 0])
    assert pi.delta == int(delta)
    assert pi.hash_prompt[:2] == [1, 2] and pi.hash_prompt[2] == (a.key, 0) and pi.hash_prompt[8] == 3
    assert pi.positions_1d(0, 2) == [0, 1] and pi.positions_1d(2, 3) is None
    # past the prompt (generated tokens): index + delta, the same on the three axes
    assert pi.positions_1d(len(out), len(out) + 2) == [len(out) + pi.delta, len(out) + 1 + pi.delta]
    p3 = pi.positions_3d(len(out) - 3, len(out) + 1)
    assert torch.equal(p3[:, :3], ref[:, 0, -3:]) and p3[:, 3].tolist() == [len(out) + pi.delta] * 3
    assert pi.images_in(0, 3) == [0] and pi.images_in(8, 11) == [] and pi.images_in(0, len(out)) == [0, 1]


def _video(groups, h, w, seed=0) -> VideoInput:
    g = torch.Generator().manual_seed(seed)
    frames = tuple(ImageInput.make(torch.randn(h * w, 12, generator=g), (1, h, w), 2, video=True)
                   for _ in range(groups))
    return VideoInput(frames, tuple(0.5 + i for i in range(groups)))


def test_video_frames_and_positions_match_get_rope_index():
    """A video of 3 frame groups (4x6 patches) after an image (8x4), its placeholder wrapped in the
    start / end tokens: each group follows its timestamp's tokens inside its own start / end, and
    the positions equal transformers' get_rope_index given the video's grid (3, 4, 6), which it
    splits into frame groups the same way. An expanded prompt is kept; unpaired ones are errors."""
    a, v = _image(1, 8, 4, 1), _video(3, 4, 6)
    encode = lambda text: [100 + len(text), 200]   # noqa: E731 (any tokens: the timestamp's text)
    ids = expand_videos([1, IMG, 2, START, VID, END, 3], [v], TOKENS, encode)
    group = [START] + [VID] * 6 + [END]
    want = [1, IMG, 2]
    for ts in v.timestamps:
        want += encode(f"<{ts:.1f} seconds>") + group
    assert ids == want + [3]
    assert expand_videos(ids, [v], TOKENS, encode) == ids   # (already expanded: kept)
    out, pi = attach_images(ids, [a, *v.frames], TOKENS, 2)
    ref, delta = _hf_rope_index(out, [list(a.grid_thw)], [[3, 4, 6]])
    assert torch.equal(pi.positions, ref[:, 0]) and pi.delta == int(delta)
    assert [im.video for im in pi.images] == [False, True, True, True] and out.count(VID) == 18
    assert pi.hash_prompt[out.index(VID)] == (v.frames[0].key, 0)
    for ids, msg in (([1, 2], "0 video placeholder"), ([1, VID, VID, 2], "placeholder of 2 tokens")):
        with pytest.raises(ValueError, match=msg):
            expand_videos(ids, [v], TOKENS, encode)


def test_expanded_placeholders_and_keys():
    """A placeholder already expanded to the image's token count is taken as it is; equal pixels
    give equal keys, other pixels other keys (so the prefix cache shares KV of the same image only)."""
    a = _image(1, 4, 4, 0)
    out, pi = attach_images([1, IMG, IMG, IMG, IMG, 2], [a], TOKENS, 2)
    assert out == [1] + [IMG] * 4 + [2]
    assert _image(1, 4, 4, 0).key == a.key != _image(1, 4, 4, 1).key


@pytest.mark.parametrize("ids, n, msg", [([1, IMG, 2], 2, "1 image placeholder"), ([1, 2], 1, "0 image placeholder"),
                                         ([1, IMG, IMG, 2], 1, "placeholder of 2 tokens")])
def test_placeholder_mismatch_is_a_value_error(ids, n, msg):
    with pytest.raises(ValueError, match=msg):
        attach_images(ids, [_image(1, 4, 6, i) for i in range(n)], TOKENS, 2)


def test_mrope_rows_match_transformers():
    """Interleaved M-RoPE rows from the one-position table equal transformers' cos/sin, partial
    rotary (8 of 16 dims) and Qwen3.5's sections; equal positions give the 1-D table's rows."""
    import transformers
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
    cfg = transformers.Qwen3_5TextConfig(head_dim=16, hidden_size=64, num_attention_heads=4, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]})
    pos = torch.randint(0, 200, (3, 1, 9), generator=torch.Generator().manual_seed(0))
    cos, sin = Qwen3_5TextRotaryEmbedding(cfg)(torch.zeros(1), pos)
    table = build_cos_sin_cache(8, 512, 10000.0)
    rows = mrope_rows(table, pos[:, 0], (2, 1, 1))
    assert torch.equal(rows, torch.cat([cos[0, :, :4], sin[0, :, :4]], -1))
    same = torch.arange(9).expand(3, -1)
    assert torch.equal(mrope_rows(table, same, (2, 1, 1)), table[:9])


def test_tower_runs_once_over_the_items_ahead(monkeypatch):
    """The first embeddings asked for run the tower once over that item and the ones after it (an
    image and a video's frame groups), each item's rows what its own call gives; under a patch
    budget of one item, one call each."""
    import blitzllm.engine.images as images_mod

    class Tower:
        calls = []

        def embed_images(self, pixel_values, grid):
            self.calls.append(grid.tolist())
            return pixel_values.view(-1, 4, 12).sum(1)   # (a merge block's 4 patches -> its token's row)

    a, v = _image(1, 4, 6, 0), _video(3, 4, 6)
    ids = expand_videos([1, IMG, START, VID, END], [v], TOKENS, lambda text: [100])
    for budget, calls in ((images_mod.EMBED_BATCH_PATCHES, 1), (24, 4)):
        monkeypatch.setattr(images_mod, "EMBED_BATCH_PATCHES", budget)
        _, pi = attach_images(ids, [a, *v.frames], TOKENS, 2)
        tower = Tower()
        tower.calls = []
        rows = [pi.embeddings(k, tower) for k in range(4)]
        assert len(tower.calls) == calls and tower.calls[0][0] == [1, 4, 6]
        for im, r in zip(pi.images, rows):
            assert torch.equal(r, im.pixel_values.view(-1, 4, 12).sum(1))
