"""Videos through the engine on a tiny random multimodal Qwen3.5 (vision tower, written by
transformers' save_pretrained) with SmolLM2's tokenizer plus Qwen's vision tokens.

The oracle is transformers: its ``Qwen3VLVideoProcessor`` (the Qwen3.5 folders' video processor:
frame sampling from the metadata, resize, normalization, patches), its ``Qwen3VLProcessor``'s
prompt for a video (a timestamp before each frame group) tokenized whole, and
``Qwen3_5ForConditionalGeneration.generate``. One stand-in: transformers resizes videos with
torchvision, which cannot be installed beside the CPU build of torch (PyPI's torchvision is a
CUDA build whose ops do not load), so ``hf_video_processor`` gives transformers torchvision's
tensor resize as torchvision defines it (float32 antialiased bicubic, clamped and rounded back
to uint8) and its normalize; every other step is transformers' code.
"""
from __future__ import annotations

import collections
import contextlib
import json
import types
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from blitzllm import LLM, SamplingParams

TAGS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
VIDEO_PREPROCESS = {"size": {"shortest_edge": 256, "longest_edge": 8192}, "patch_size": 4, "temporal_patch_size": 2,
                    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
IMAGE_PREPROCESS = {"size": {"shortest_edge": 256, "longest_edge": 4096}, "patch_size": 4, "temporal_patch_size": 2,
                    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
WRAP = "<|vision_start|><|video_pad|><|vision_end|>"
TEMPLATE = r"""
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' }}
    {%- if message.content is string %}{{- message.content }}
    {%- else %}{%- for item in message.content %}
        {%- if item.type == 'image' or 'image' in item or 'image_url' in item %}
            {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
        {%- elif item.type == 'video' or 'video' in item or 'video_url' in item %}
            {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
        {%- elif 'text' in item %}{{- item.text }}{%- endif %}
    {%- endfor %}{%- endif %}
    {{- '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
""".strip()


def _tv_resize(img, size, interpolation=None, antialias=True):
    """torchvision's resize of a uint8 tensor [..., C, H, W] (bicubic): float32, interpolate, clamp, round."""
    assert interpolation == "bicubic"
    if tuple(size) == tuple(img.shape[-2:]):
        return img
    x = F.interpolate(img.reshape(-1, *img.shape[-3:]).float(), size=list(size), mode="bicubic",
                      align_corners=False, antialias=antialias)
    return x.clamp_(0, 255).round_().to(torch.uint8).reshape(*img.shape[:-2], *x.shape[-2:])


def _tv_normalize(t, mean, std, inplace=False):
    return (t - torch.as_tensor(mean).view(-1, 1, 1)) / torch.as_tensor(std).view(-1, 1, 1)


@contextlib.contextmanager
def transformers_video_processor():
    """transformers' Qwen3VLVideoProcessor (VIDEO_PREPROCESS) with the torchvision stand-in."""
    import transformers.image_processing_backends as backends
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    tvf = types.SimpleNamespace(resize=_tv_resize, normalize=_tv_normalize, InterpolationMode=types.SimpleNamespace(
        BICUBIC="bicubic", LANCZOS="lanczos", BILINEAR="bilinear"))
    with pytest.MonkeyPatch.context() as mp:
        if backends.pil_torch_interpolation_mapping is None:   # (no torchvision)
            mp.setattr(backends, "tvF", tvf, raising=False)
            mp.setattr(backends, "pil_torch_interpolation_mapping", collections.defaultdict(lambda: "bicubic"))
        yield Qwen3VLVideoProcessor(**VIDEO_PREPROCESS)


@pytest.fixture(scope="module")
def hf_video_processor():
    with transformers_video_processor() as proc:
        yield proc


def hf_video_inputs(proc, frames: np.ndarray, meta: dict, **kw) -> tuple:
    """(pixel_values_videos, video_grid_thw, the prompt text replacing the video's wrapper) of transformers."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    b = proc(videos=[frames], video_metadata=[{"total_num_frames": len(frames), **meta}], return_metadata=True, return_tensors="pt",
             do_convert_rgb=False, cap_pixels_per_frame=False, **kw)
    ns = types.SimpleNamespace(video_processor=proc, video_token="<|video_pad|>", vision_start_token=TAGS[0],
                               vision_end_token=TAGS[2],
                               _calculate_timestamps=partial(Qwen3VLProcessor._calculate_timestamps, None))
    return b["pixel_values_videos"], b["video_grid_thw"], Qwen3VLProcessor.replace_video_token(ns, b, 0)


def _frames(t, h, w, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


def tiny_vl(folder):
    """(transformers' model, tokenizer) of a 4-layer random multimodal Qwen3.5 written to ``folder``:
    SmolLM2's tokenizer with Qwen's vision tokens (TAGS) and TEMPLATE, the processors' configs."""
    import transformers
    from blitzllm.loader.source import smollm2_path
    from blitzllm.loader.tokenizer import load_gguf_tokenizer
    from tests.models.test_qwen3_next import HYBRID, VISION
    tok = load_gguf_tokenizer(smollm2_path())
    tok.add_special_tokens({"additional_special_tokens": TAGS})
    start, pad, end, vpad = tok.convert_tokens_to_ids(TAGS)
    torch.manual_seed(0)
    text = dict(HYBRID, intermediate_size=96, vocab_size=len(tok), max_position_embeddings=2048,
                eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=VISION, image_token_id=pad, video_token_id=vpad,
                                     vision_start_token_id=start, vision_end_token_id=end)
    hf = transformers.Qwen3_5ForConditionalGeneration(cfg).float().eval()
    hf.save_pretrained(str(folder), safe_serialization=True)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(folder))
    (folder / "preprocessor_config.json").write_text(json.dumps(IMAGE_PREPROCESS))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESS))
    return hf, tok


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(transformers' model, tokenizer, folder) of ``tiny_vl``."""
    folder = tmp_path_factory.mktemp("qwen3_5_video")
    return (*tiny_vl(folder), folder)


def hf_greedy(hf, tok, prompt: str, videos: list, proc, n: int, images=()) -> tuple:
    """(transformers' greedy tokens, its prompt ids): each video ((frames, metadata) in order) replaces
    the next video wrapper of ``prompt`` as Qwen3VLProcessor writes it, images as its image processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    pixels, grids = [], []
    for frames, meta in videos:
        pv, grid, text = hf_video_inputs(proc, frames, meta)
        prompt = prompt.replace(WRAP, text.replace("<|video_pad|>", "\0"), 1)
        pixels.append(pv)
        grids.append(grid)
    prompt = prompt.replace("\0", "<|video_pad|>")
    _, pad, _, vpad = tok.convert_tokens_to_ids(TAGS)
    kw = {}
    if images:
        batch = Qwen2VLImageProcessorPil(**IMAGE_PREPROCESS)(images=list(images), return_tensors="pt")
        prompt = prompt.split("<|image_pad|>")
        prompt = "".join(p + "<|image_pad|>" * int(g.prod() // 4) for p, g in zip(prompt, batch["image_grid_thw"])) \
            + prompt[-1]
        kw = dict(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    if videos:
        kw.update(pixel_values_videos=torch.cat(pixels), video_grid_thw=torch.cat(grids))
    ids, kw = ids.to(hf.device), {k: v.to(hf.device) for k, v in kw.items()}
    with torch.no_grad():
        gen = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == pad).int()
                          + 2 * (ids == vpad).int(), max_new_tokens=n, do_sample=False, **kw)
    return gen[0, ids.shape[1]:].tolist(), ids[0].tolist()


def test_processor_matches_transformers(hf_video_processor):
    """Frames sampled at 2 fps from the source's rate (resized), frames sampled already (an odd
    count: the last one repeats), a fixed frame count, and an unknown rate (24 assumed): the same
    pixels, grids and timestamps as transformers'."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from blitzllm.engine.video import Video, VideoProcessor
    ours = VideoProcessor(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=256, max_pixels=8192)
    cases = [(_frames(20, 30, 50), {"fps": 10.0}, {}, ours),
             (_frames(5, 17, 26, 1), {"fps": 4.0, "frames_indices": [0, 3, 7, 9, 12]}, {"do_sample_frames": False},
              ours),
             (_frames(12, 24, 40, 2), {"fps": 30.0}, {"num_frames": 6, "fps": None}, VideoProcessor(**{**ours.__dict__,
                                                                                            "num_frames": 6})),
             (_frames(100, 64, 48, 3), {}, {}, ours)]
    for frames, meta, kw, proc in cases:
        pv, grid, _ = hf_video_inputs(hf_video_processor, frames, meta, **kw)
        video = proc(Video(frames, meta.get("fps"), meta.get("frames_indices")))
        assert torch.equal(torch.cat([f.pixel_values for f in video.frames]), pv)
        t, h, w = grid[0].tolist()
        assert [f.grid_thw for f in video.frames] == [(1, h, w)] * t and all(f.video for f in video.frames)
        idx = meta.get("frames_indices") or np.linspace(0, len(frames) - 1, min(max(
            kw.get("num_frames") or int(len(frames) / meta.get("fps", 24.0) * 2), 4), len(frames))).round().astype(int)
        want = Qwen3VLProcessor._calculate_timestamps(None, list(idx), meta.get("fps", 24.0), 2)
        assert list(video.timestamps) == want


def test_greedy_matches_transformers(vl, hf_video_processor):
    """A video in a prompt; an image and a video; two videos of different sizes: the prompt ids
    are transformers' (timestamps and frame groups) and so are the greedy tokens, from the text
    and (one video) from its token ids."""
    hf, tok, folder = vl
    llm = LLM(str(folder), dtype="float32", kv_cache_blocks=128, max_num_seqs=2)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    from PIL import Image
    image = Image.fromarray(_frames(1, 24, 40, 9)[0])
    head, tail = "<|im_start|>user\n", "Describe.<|im_end|>\n<|im_start|>assistant\n"
    one = [(_frames(20, 30, 50), {"fps": 10.0})]
    two = [(_frames(16, 20, 28, 4), {"fps": 8.0}), (_frames(9, 33, 21, 5), {"fps": 3.0})]
    try:
        for prompt, videos, images in (
                (head + WRAP + tail, one, ()),
                (head + WRAP + "then<|vision_start|><|image_pad|><|vision_end|>" + tail, one, (image,)),
                (head + WRAP + " and " + WRAP + tail, two, ())):
            want, want_ids = hf_greedy(hf, tok, prompt, videos, hf_video_processor, 6, images)
            mm = {"video": [(f, {**m}) for f, m in videos]}
            if images:
                mm["image"] = list(images)
            out = llm.generate({"prompt": prompt, "multi_modal_data": mm}, greedy)[0]
            assert out.prompt_token_ids == want_ids
            assert out.outputs[0].token_ids == want
            # the prompt as token ids: the frame groups written in token space (the timestamps
            # tokenized alone), the same ids here, where a newline or a vision token precedes each
            if images or prompt.count(WRAP) == 1:
                ids = tok(prompt, add_special_tokens=False).input_ids
                out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": mm}, greedy)[0]
                assert out.prompt_token_ids == want_ids and out.outputs[0].token_ids == want
        assert llm.stats()["kv_blocks_free"] == 128
    finally:
        llm.engine.close()


def test_chat_chunked_prefill_and_prefix_cache(vl, hf_video_processor):
    """LLM.chat with a video part ({"type": "video", "video": (frames, metadata)}): transformers'
    answer with a 16-token budget cutting through the frame groups; the same video again hits the
    prefix cache past its frames, another video of the same size does not."""
    hf, tok, folder = vl
    llm = LLM(str(folder), dtype="float32", kv_cache_blocks=128, max_num_seqs=2, max_num_batched_tokens=16,
              block_size=4)
    a, b = (_frames(20, 30, 50, 6), {"fps": 10.0}), (_frames(20, 30, 50, 7), {"fps": 10.0})
    try:
        for video, hit in ((a, False), (a, True), (b, False)):
            messages = [{"role": "user", "content": [{"type": "video", "video": video},
                                                     {"type": "text", "text": "What happens?"}]}]
            prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            want, want_ids = hf_greedy(hf, tok, prompt, [video], hf_video_processor, 5)
            before = llm.stats()["prefix_cache_hit_tokens"]
            out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5))[0]
            assert out.outputs[0].token_ids == want and out.prompt_token_ids == want_ids
            gained = llm.stats()["prefix_cache_hit_tokens"] - before
            assert (gained >= len(want_ids) - 16) if hit else gained <= 8   # (the text before the first frame)
        assert llm.stats()["kv_blocks_free"] == 128
    finally:
        llm.engine.close()


def test_processor_options_and_refusals(vl):
    """mm_processor_kwargs fps / num_frames set the frames sampled; limit_mm_per_prompt caps the
    videos; a one-frame video, frames that are not a video, videos and placeholders that do not
    pair up and bad options are ValueErrors; the engine serves the next request."""
    _, tok, folder = vl
    vpad = tok.convert_tokens_to_ids("<|video_pad|>")
    prompt = "<|im_start|>user\n" + WRAP + "Hi<|im_end|>\n"
    # 4 s of 24 x 40 frames: 8 frames at 2 fps, 4 groups of 6 x 10 patches (15 tokens); at 1 fps the 4
    # frames at least; 12 frames are over the 8192-pixel budget, resized to 16 x 32 (8 tokens a group)
    video = (_frames(40, 24, 40, 8), {"fps": 10.0})
    for kw, groups, tokens in (({"fps": 1.0}, 2, 15), ({"num_frames": 12}, 6, 8), ({}, 4, 15)):
        llm = LLM(str(folder), dtype="float32", kv_cache_blocks=64, mm_processor_kwargs=kw,
                  limit_mm_per_prompt={"video": 1})
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"video": video}}, SamplingParams(max_tokens=1))[0]
        assert out.prompt_token_ids.count(vpad) == groups * tokens
        if kw:
            llm.engine.close()
    cases = [({"prompt": prompt, "multi_modal_data": {"video": (_frames(1, 24, 40), {"fps": 1.0})}},
              "at least 2 frames"),
             ({"prompt": prompt, "multi_modal_data": {"video": "clip.mp4"}}, "uint8 RGB frames"),
             ({"prompt": prompt, "multi_modal_data": {"video": _frames(4, 0, 8)}}, "no frames or no pixels"),
             ({"prompt": prompt, "multi_modal_data": {"video": (_frames(4, 8, 8), {"fps": -1})}}, "positive"),
             ({"prompt": "no placeholder", "multi_modal_data": {"video": video}}, "0 video placeholder"),
             ({"prompt": prompt + WRAP, "multi_modal_data": {"video": video}}, "2 video placeholder"),
             ({"prompt": prompt, "multi_modal_data": {"video": [video, video]}}, "at most 1"),
             (prompt, "no videos came")]
    for bad, msg in cases:
        with pytest.raises(ValueError, match=msg):
            llm.generate(bad, SamplingParams(max_tokens=2))
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"video": video}}, SamplingParams(max_tokens=2))[0]
    assert len(out.outputs[0].token_ids) == 2 and llm.stats()["kv_blocks_free"] == 64
    llm.engine.close()
    for kw, msg in ((dict(mm_processor_kwargs={"fps": 0}), "positive number"),
                    (dict(mm_processor_kwargs={"fps": 1, "num_frames": 4}), "exclude each other"),
                    (dict(limit_mm_per_prompt={"audio": 1}), "takes 'image' and 'video'")):
        with pytest.raises(ValueError, match=msg):
            LLM(str(folder), dtype="float32", kv_cache_blocks=64, **kw)


def test_tensor_parallel_video(vl, hf_video_processor):
    """tensor_parallel_size=2 on the CPU (gloo), 16-token chunks through the frame groups: rank 0
    runs the tower over the video and hands the ranks its rows; transformers' tokens."""
    hf, tok, folder = vl
    video = (_frames(20, 30, 50, 10), {"fps": 10.0})
    prompt = "<|im_start|>user\n" + WRAP + "Describe.<|im_end|>\n<|im_start|>assistant\n"
    want, want_ids = hf_greedy(hf, tok, prompt, [video], hf_video_processor, 5)
    with LLM(str(folder), device="cpu", dtype="float32", kv_cache_blocks=64, max_num_seqs=2, tensor_parallel_size=2,
             max_num_batched_tokens=16, block_size=4) as llm:
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"video": video}},
                           SamplingParams(temperature=0, max_tokens=5))[0]
        assert out.prompt_token_ids == want_ids and out.outputs[0].token_ids == want
        assert llm.stats()["kv_blocks_free"] == 64


@pytest.mark.gpu
def test_video_on_cuda_matches_transformers(vl, hf_video_processor):
    """fp32 on CUDA with the decode graphs captured, whole and in 16-token chunks: transformers'
    greedy tokens (its model on the GPU too) for a prompt with a video, and no KV left held."""
    hf, tok, folder = vl
    video = (_frames(20, 30, 50, 11), {"fps": 10.0})
    prompt = "<|im_start|>user\n" + WRAP + "Describe.<|im_end|>\n<|im_start|>assistant\n"
    want, want_ids = hf_greedy(hf.to("cuda"), tok, prompt, [video], hf_video_processor, 8)
    hf.to("cpu")
    for kw in (dict(), dict(max_num_batched_tokens=16)):
        llm = LLM(str(folder), device="cuda", dtype="float32", kv_cache_blocks=64, max_num_seqs=2, **kw)
        try:
            assert llm.engine.runner.graphs is not None
            out = llm.generate({"prompt": prompt, "multi_modal_data": {"video": video}},
                               SamplingParams(temperature=0, max_tokens=8))[0]
            assert out.outputs[0].token_ids == want and out.prompt_token_ids == want_ids
            assert llm.stats()["kv_blocks_free"] == 64
        finally:
            llm.engine.close()


def test_speculation_over_a_video(vl, hf_video_processor):
    """n-gram speculation over a prompt with a video and 280 tokens after it, 40 tokens generated
    (drafts where an n-gram recurs; verify steps run as forwards with the rotary positions past the
    frame groups): transformers' greedy tokens on the same expanded prompt
    (test_greedy_matches_transformers checks the expansion), every block back."""
    hf, tok, folder = vl
    frames, meta = _frames(20, 30, 50, 12), {"fps": 10.0}
    ids = tok("<|im_start|>user\n" + WRAP, add_special_tokens=False).input_ids + list(range(20, 300))
    llm = LLM(str(folder), dtype="float32", kv_cache_blocks=64, max_num_seqs=2,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": (frames, meta)}},
                           SamplingParams(temperature=0, max_tokens=40))[0]
        assert llm.stats()["kv_blocks_free"] == 64 and llm.stats()["spec_draft_tokens"] > 0
    finally:
        llm.engine.close()
    pv, grid, _ = hf_video_inputs(hf_video_processor, frames, meta)
    x = torch.tensor([out.prompt_token_ids])
    vpad = tok.convert_tokens_to_ids("<|video_pad|>")
    with torch.no_grad():
        gen = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values_videos=pv, video_grid_thw=grid,
                          mm_token_type_ids=2 * (x == vpad).int(), max_new_tokens=40, do_sample=False)
    assert out.outputs[0].token_ids == gen[0, x.shape[1]:].tolist()
