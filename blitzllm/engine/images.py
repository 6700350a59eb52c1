"""Images and videos in a prompt (multimodal Qwen3.5), from the request to the runner.

A video is a run of frame groups, each an ``ImageInput`` of its own (``engine/video.py``):
``expand_videos`` writes each video's frames into the prompt, every group after its timestamp,
and from there a group is handled as an image with the video token as its placeholder.
``attach_images`` expands each image placeholder of the prompt (a run of the model's image
token) to the image's number of embeddings and returns a ``PromptImages``: where each image's
tokens sit, their M-RoPE positions (time, height, width per token, as transformers'
``get_rope_index``; text tokens have three equal ones) and the prompt the prefix cache hashes,
in which an image's tokens are (image key, index) so KV is shared only for the same pixels.
The runner reads it per scheduled chunk: ``positions_1d`` where a chunk is text only (then
rotary needs one position a token: index + ``delta`` past the last image), ``positions_3d``
where a chunk holds image tokens; it computes an image's embeddings once and keeps them in
``embeds`` until the prefill is past the image.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import torch

from ..pooling_params import PoolingParams, json_object
from .multimodal import ImageInput, ImageProcessor, VideoInput
from .video import Video, VideoProcessor

EMBED_BATCH_PATCHES = 16384   # the most patches one vision tower call takes (its activations scale with them)


@dataclass(frozen=True)
class VisionTokens:
    """The model's vision placeholders: the image and video tokens and the start / end tokens
    around each image or frame group."""
    image: int
    video: int
    start: int
    end: int


@dataclass(eq=False)
class PromptImages:
    images: list                 # ImageInput, in prompt order
    offsets: list                # each image's first token index in the prompt
    positions: torch.Tensor      # [3, prompt length] M-RoPE positions (int64)
    delta: int                   # rotary position - token index, for every token past the last image
    hash_prompt: list            # the prompt for the prefix cache's hashes
    merge: int                   # the vision tower's spatial merge
    embeds: dict = field(default_factory=dict)   # image index -> its embeddings [num_tokens, hidden]
    mrope = True                 # its chunks with image tokens take M-RoPE rows
    text_ids = True              # its prompt ids are real tokens (images' placeholders aside)

    def images_in(self, start: int, end: int) -> list:
        """Indices of the images with tokens in [start, end)."""
        return [k for k, (o, im) in enumerate(zip(self.offsets, self.images)) if o < end and o + im.num_tokens > start]

    def span(self, k: int) -> tuple:
        """(first token index, tokens) of image k in the prompt."""
        return self.offsets[k], self.images[k].num_tokens

    def embeddings(self, k: int, model) -> torch.Tensor:
        """Image k's embeddings [num_tokens, hidden], from ``model``'s vision tower on first use:
        one call over k and the images after it not computed yet, up to EMBED_BATCH_PATCHES
        patches (a video's frame groups go through the tower together, not one call each)."""
        if k not in self.embeds:
            batch, patches = [], 0
            for j in range(k, len(self.images)):
                n = self.images[j].pixel_values.shape[0]
                if j in self.embeds or (batch and patches + n > EMBED_BATCH_PATCHES):
                    break
                batch.append(j)
                patches += n
            ims = [self.images[j] for j in batch]
            out = model.embed_images(torch.cat([im.pixel_values for im in ims]),
                                     torch.tensor([im.grid_thw for im in ims]))
            self.embeds.update(zip(batch, out.split([im.num_tokens for im in ims])))
        return self.embeds[k]

    def positions_1d(self, start: int, end: int) -> Optional[list]:
        """Rotary positions of tokens [start, end) when none is an image token, else None."""
        if self.images_in(start, end):
            return None
        n = self.positions.shape[1]
        head = self.positions[0, start:min(end, n)].tolist() if start < n else []
        return head + [i + self.delta for i in range(max(start, n), end)]

    def positions_3d(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] M-RoPE positions of tokens [start, end)."""
        n = self.positions.shape[1]
        tail = torch.arange(max(start, n), max(end, n), dtype=torch.int64) + self.delta
        return torch.cat([self.positions[:, start:min(end, n)], tail.expand(3, -1)], 1)

    def release(self, num_computed: int) -> None:
        """Drop the embeddings of images the prefill is past."""
        for k in [k for k in self.embeds if self.offsets[k] + self.images[k].num_tokens <= num_computed]:
            del self.embeds[k]


def _runs(ids: list, token: int) -> list:
    """(start, length) of each maximal run of ``token`` in ``ids``."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def expand_videos(ids: list, videos: list, tokens: VisionTokens, encode) -> list:
    """``ids`` with each video's placeholder (one video token, with the chat template's start and
    end tokens around it or not) replaced by its frame groups, each ``encode("<t seconds>")``, the
    start token, the group's video tokens and the end token (vLLM's Qwen3-VL prompt: the timestamps
    tokenized on their own). A prompt already so expanded is kept as it is."""
    runs = _runs(ids, tokens.video)
    frames = [f for v in videos for f in v.frames]
    if len(runs) == len(frames) and all(n == f.num_tokens for (_, n), f in zip(runs, frames)):
        return ids
    if len(runs) != len(videos):
        raise ValueError(f"the prompt has {len(runs)} video placeholder(s) (token {tokens.video}) for "
                         f"{len(videos)} video(s): put one placeholder where each video goes (the chat template "
                         "does this for video content parts)")
    out, last = [], 0
    for (start, n), v in zip(runs, videos):
        if n != 1:
            raise ValueError(f"a video placeholder of {n} tokens: give one video token per video")
        a, b = start, start + 1
        if a > 0 and b < len(ids) and ids[a - 1] == tokens.start and ids[b] == tokens.end:
            a, b = a - 1, b + 1
        out += ids[last:a]
        for f, ts in zip(v.frames, v.timestamps):
            out += list(encode(f"<{ts:.1f} seconds>")) + [tokens.start] + [tokens.video] * f.num_tokens + [tokens.end]
        last = b
    return out + ids[last:]


def attach_images(ids: list, images: list, tokens: VisionTokens, merge: int) -> tuple[list, PromptImages]:
    """(expanded prompt ids, PromptImages): the k-th run of the image token is the k-th image's
    placeholder, one token (expanded to its ``num_tokens``) or already that many; runs of the video
    token are the videos' frame groups (``images`` holds them, ``video`` set, after ``expand_videos``)."""
    queues = {}
    for video, token, what in ((False, tokens.image, "image"), (True, tokens.video, "video frame group")):
        items = [im for im in images if im.video == video]
        runs = _runs(ids, token)
        if len(runs) != len(items):
            raise ValueError(f"the prompt has {len(runs)} {what} placeholder(s) (token {token}) for "
                             f"{len(items)} {what}(s): put one placeholder where each {what} goes (the chat "
                             f"template does this for {what.split()[0]} content parts)")
        queues[video] = list(zip(runs, items))
    order = sorted(queues[False] + queues[True], key=lambda x: x[0][0])
    out, offsets, pos, hashed = [], [], [], []
    cur, last = 0, 0
    for (start, length), im in order:
        if length not in (1, im.num_tokens):
            raise ValueError(f"an image placeholder of {length} tokens for an image of {im.num_tokens}: "
                             "give one placeholder token per image")
        text = ids[last:start]
        out += text
        hashed += text
        pos.append(torch.arange(cur, cur + len(text)).expand(3, -1))
        cur += len(text)
        offsets.append(len(out))
        t, h, w = im.grid_thw[0], im.grid_thw[1] // merge, im.grid_thw[2] // merge
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        pos.append(torch.stack([tt, hh, ww]).reshape(3, -1) + cur)
        cur += max(h, w)
        out += [tokens.video if im.video else tokens.image] * im.num_tokens
        hashed += [(im.key, j) for j in range(im.num_tokens)]
        last = start + length
    out += ids[last:]
    hashed += ids[last:]
    pos.append(torch.arange(cur, cur + len(ids) - last).expand(3, -1))
    positions = torch.cat(pos, 1).to(torch.int64)
    delta = int(positions.max()) + 1 - len(out)
    return out, PromptImages([im for _, im in order], offsets, positions, delta, hashed, merge)


def step_images(seqs) -> Optional[list]:
    """Per scheduled sequence its PromptImages or None; None when no sequence has images."""
    ims = [s.req.images for s in seqs]
    return ims if any(im is not None for im in ims) else None


def release_images(seqs) -> None:
    """After a step: drop the embeddings of images each prefill is now past."""
    for s in seqs:
        if s.req.images is not None:
            s.req.images.release(s.req.num_computed_tokens)


def check_images(intake, architecture: str, params, kv_transfer_params) -> None:
    """What a request with images or videos may not ask for (a ValueError)."""
    if intake is None:
        raise ValueError(f"{architecture} takes no images or videos (this checkpoint has no vision tower)")
    if isinstance(params, PoolingParams):
        raise ValueError("embeddings and classification take text only, no images or videos")
    if kv_transfer_params:
        raise ValueError("requests with images or videos are not disaggregated (kv_transfer_params)")


_MM_KWARGS = {"min_pixels": "image", "max_pixels": "image", "fps": "video", "num_frames": "video"}


def parse_mm_args(processor_kwargs, limit) -> tuple[dict, dict, dict]:
    """(the image processor's overrides, the video processor's, the most items of each kind a
    prompt may hold) of vLLM's ``mm_processor_kwargs`` ({"min_pixels", "max_pixels"} of an image,
    {"fps" (frames sampled per second), "num_frames"} of a video) and ``limit_mm_per_prompt``
    ({"image": N, "video": N})."""
    kw = json_object(processor_kwargs, "mm_processor_kwargs") if processor_kwargs is not None else {}
    for key, v in kw.items():
        if key not in _MM_KWARGS:
            raise ValueError(f"mm_processor_kwargs takes {', '.join(_MM_KWARGS)}, got {key!r}")
        number = (int, float) if key == "fps" else int
        if not isinstance(v, number) or isinstance(v, bool) or not v > 0:
            raise ValueError(f"mm_processor_kwargs.{key} must be a positive {'number' if key == 'fps' else 'integer'}"
                             f", got {v!r}")
    if kw.get("min_pixels", 1) > kw.get("max_pixels", kw.get("min_pixels", 1)):
        raise ValueError("mm_processor_kwargs: min_pixels must be <= max_pixels")
    if "fps" in kw and "num_frames" in kw:
        raise ValueError("mm_processor_kwargs: fps and num_frames exclude each other (a sampling rate or a count)")
    lim = json_object(limit, "limit_mm_per_prompt") if limit is not None else {}
    if set(lim) - {"image", "video"}:
        raise ValueError(f"limit_mm_per_prompt takes 'image' and 'video' (items per prompt), got {sorted(lim)}")
    for kind, n in lim.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"limit_mm_per_prompt.{kind} must be an integer >= 0, got {n!r}")
    split = [{k: v for k, v in kw.items() if _MM_KWARGS[k] == kind} for kind in ("image", "video")]
    return split[0], split[1], lim


class ImageIntake:
    """The engine's side of a model with a vision tower: its image and video processors, its
    placeholder tokens and spatial merge, and the checks an image or video request passes.
    ``tokenizer``: the model's (the videos' timestamps are text), or None."""

    def __init__(self, model, folder, hf_config: dict, processor_kwargs=None, limit=None, tokenizer=None):
        kw, video_kw, self.limits = parse_mm_args(processor_kwargs, limit)
        proc = ImageProcessor.from_model(folder, hf_config)
        if "min_pixels" in kw and "max_pixels" not in kw:   # (a floor over the folder's ceiling lifts it)
            kw["max_pixels"] = max(kw["min_pixels"], proc.max_pixels)
        if "max_pixels" in kw and "min_pixels" not in kw:
            kw["min_pixels"] = min(kw["max_pixels"], proc.min_pixels)
        self.processor = dataclasses.replace(proc, **kw)
        video = VideoProcessor.from_model(folder, hf_config)
        if video_kw:   # (a rate asked replaces the folder's count, and a count its rate)
            video_kw = {"num_frames": None, **video_kw} if "fps" in video_kw else video_kw
        self.video_processor = dataclasses.replace(video, **video_kw)
        self.tokens = VisionTokens(model.image_token_id, model.video_token_id, model.vision_start_token_id,
                                   model.vision_end_token_id)
        self.token, self.merge = model.image_token_id, model.spatial_merge_size
        self.encode = None if tokenizer is None else partial(tokenizer.encode, add_special_tokens=False)
        self.token_text = (None,) * 3 if tokenizer is None else tuple(tokenizer.convert_ids_to_tokens(
            [self.tokens.start, self.tokens.video, self.tokens.end]))

    @staticmethod
    def of(model, folder, hf_config: dict, args=None, tokenizer=None) -> Optional["ImageIntake"]:
        if getattr(model, "visual", None) is None:
            return None
        return ImageIntake(model, folder, hf_config, getattr(args, "mm_processor_kwargs", None),
                           getattr(args, "limit_mm_per_prompt", None), tokenizer)

    def check_count(self, n: int, kind: str = "image") -> None:
        limit = self.limits.get(kind)
        if limit is not None and n > limit:
            raise ValueError(f"{n} {kind}s in one prompt; at most {limit} are taken (limit_mm_per_prompt)")

    def image(self, image) -> ImageInput:
        """A PIL image (or an ImageInput made earlier, as the server does off the engine thread)."""
        if isinstance(image, ImageInput):
            return image
        from PIL import Image
        if not isinstance(image, Image.Image):
            raise ValueError(f"an image must be a PIL.Image.Image, got {type(image).__name__}")
        return ImageInput.make(*self.processor(image), self.merge)

    def media(self, item):
        """A PIL image -> ImageInput; a video (``engine/video.py``'s ``Video``) -> VideoInput; either
        made earlier passes."""
        if isinstance(item, (ImageInput, VideoInput)):
            return item
        return self.video_processor(item) if isinstance(item, Video) else self.image(item)

    def check_text(self, ids: list) -> None:
        """A prompt without images may not hold the image or video token: it would run as a text token."""
        for token, what in ((self.tokens.image, "image"), (self.tokens.video, "video")):
            if token in ids:
                raise ValueError(f"the prompt holds {what} placeholder tokens ({token}) but no {what}s came with it")

    def inputs(self, items) -> list:
        """PIL images and ``Video``s (or their inputs made earlier) -> ImageInputs and VideoInputs,
        the per-prompt limits checked first."""
        items = list(items) if isinstance(items, (list, tuple)) else [items]
        videos = sum(_is_video(x) for x in items)
        self.check_count(len(items) - videos)
        self.check_count(videos, "video")
        return [self.media(x) for x in items]

    def expand_text(self, text: str, items: list) -> str:
        """A text prompt with each video's placeholder (its token, in the start / end wrapper or not)
        replaced by the video's frame groups, as transformers' Qwen3VLProcessor writes them before
        tokenizing (the timestamps tokenized with the text around them). Left as it is when the
        placeholders and the videos do not pair up (``expand_videos`` says how)."""
        videos = [x for x in items if isinstance(x, VideoInput)]
        start, video, end = self.token_text
        if not videos or text.count(video) != len(videos):
            return text
        parts = text.split(video)
        out = parts[0]
        for v, after in zip(videos, parts[1:]):
            wrapped = out.endswith(start) and after.startswith(end)
            if wrapped:
                out, after = out[:-len(start)], after[len(end):]
            out += "".join(f"<{ts:.1f} seconds>{start}{video * f.num_tokens}{end}"
                           for f, ts in zip(v.frames, v.timestamps))
            out += after
        return out

    def attach(self, ids: list, items: list, params) -> tuple[list, PromptImages]:
        """(the prompt ids with the placeholders of ``items`` (from ``inputs``) expanded, the PromptImages)."""
        if getattr(params, "truncate_prompt_tokens", None) is not None:
            raise ValueError("truncate_prompt_tokens does not go with images (it could cut an image's tokens)")
        return self.expand(ids, items, attach=True)

    def expand(self, ids: list, items: list, attach: bool = False):
        """``ids`` with the placeholders of ``items`` (ImageInputs and VideoInputs) expanded; with
        ``attach``: (those ids, the PromptImages)."""
        videos = [x for x in items if isinstance(x, VideoInput)]
        if videos:
            if self.encode is None:
                raise ValueError("videos need the model's tokenizer (their timestamps are text)")
            ids = expand_videos(ids, videos, self.tokens, self.encode)
        images = [f for x in items for f in (x.frames if isinstance(x, VideoInput) else (x,))]
        out = attach_images(ids, images, self.tokens, self.merge)
        return out if attach else out[0]


def _is_video(item) -> bool:
    return isinstance(item, (Video, VideoInput))
