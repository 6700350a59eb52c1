"""Images in a prompt (multimodal Qwen3.5), from the request to the runner.

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
import hashlib
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..pooling_params import PoolingParams, json_object


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image as the model's processor made it."""
    pixel_values: torch.Tensor   # [patches, channels * temporal_patch * patch * patch], float32
    grid_thw: tuple              # (t, h, w) in patches
    num_tokens: int              # its embeddings in the prompt: t * h * w // merge**2
    key: str                     # content hash: equal pixels, equal key

    @classmethod
    def make(cls, pixel_values: torch.Tensor, grid_thw: tuple, merge: int) -> "ImageInput":
        t, h, w = (int(v) for v in grid_thw)
        digest = hashlib.sha256(pixel_values.contiguous().numpy().tobytes())
        digest.update(repr((t, h, w)).encode())
        return cls(pixel_values, (t, h, w), t * h * w // merge ** 2, digest.hexdigest())


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
        """Image k's embeddings [num_tokens, hidden], from ``model``'s vision tower on first use."""
        if k not in self.embeds:
            img = self.images[k]
            self.embeds[k] = model.embed_images(img.pixel_values, torch.tensor([img.grid_thw]))
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


def attach_images(ids: list, images: list, image_token_id: int, merge: int) -> tuple[list, PromptImages]:
    """(expanded prompt ids, PromptImages): the k-th run of ``image_token_id`` is image k's
    placeholder, one token (expanded to its ``num_tokens``) or already that many."""
    runs = _runs(ids, image_token_id)
    if len(runs) != len(images):
        raise ValueError(f"the prompt has {len(runs)} image placeholder(s) (token {image_token_id}) for "
                         f"{len(images)} image(s): put one placeholder where each image goes (the chat template "
                         "does this for image content parts)")
    out, offsets, pos, hashed = [], [], [], []
    cur, last = 0, 0
    for (start, length), im in zip(runs, images):
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
        out += [image_token_id] * im.num_tokens
        hashed += [(im.key, j) for j in range(im.num_tokens)]
        last = start + length
    out += ids[last:]
    hashed += ids[last:]
    pos.append(torch.arange(cur, cur + len(ids) - last).expand(3, -1))
    positions = torch.cat(pos, 1).to(torch.int64)
    delta = int(positions.max()) + 1 - len(out)
    return out, PromptImages(list(images), offsets, positions, delta, hashed, merge)


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
    """What a request with images may not ask for (a ValueError)."""
    if intake is None:
        raise ValueError(f"{architecture} takes no images (this checkpoint has no vision tower)")
    if isinstance(params, PoolingParams):
        raise ValueError("embeddings and classification take text only, no images")
    if kv_transfer_params:
        raise ValueError("requests with images are not disaggregated (kv_transfer_params)")


def parse_mm_args(processor_kwargs, limit) -> tuple[dict, Optional[int]]:
    """(the image processor's overrides, the most images a prompt may hold or None) of vLLM's
    ``mm_processor_kwargs`` ({"min_pixels", "max_pixels"}) and ``limit_mm_per_prompt`` ({"image": N})."""
    kw = json_object(processor_kwargs, "mm_processor_kwargs") if processor_kwargs is not None else {}
    for key, v in kw.items():
        if key not in ("min_pixels", "max_pixels"):
            raise ValueError(f"mm_processor_kwargs takes min_pixels and max_pixels, got {key!r}")
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"mm_processor_kwargs.{key} must be a positive integer, got {v!r}")
    if kw.get("min_pixels", 1) > kw.get("max_pixels", kw.get("min_pixels", 1)):
        raise ValueError("mm_processor_kwargs: min_pixels must be <= max_pixels")
    lim = json_object(limit, "limit_mm_per_prompt") if limit is not None else {}
    if set(lim) - {"image"}:
        raise ValueError(f"limit_mm_per_prompt takes 'image' (images per prompt), got {sorted(lim)}")
    n = lim.get("image")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise ValueError(f"limit_mm_per_prompt.image must be an integer >= 0, got {n!r}")
    return kw, n


class ImageIntake:
    """The engine's side of a model with a vision tower: its image processor, placeholder token
    and spatial merge, and the checks an image request passes."""

    def __init__(self, model, folder, hf_config: dict, processor_kwargs=None, limit=None):
        from .multimodal import ImageProcessor
        kw, self.limit = parse_mm_args(processor_kwargs, limit)
        proc = ImageProcessor.from_model(folder, hf_config)
        if "min_pixels" in kw and "max_pixels" not in kw:   # (a floor over the folder's ceiling lifts it)
            kw["max_pixels"] = max(kw["min_pixels"], proc.max_pixels)
        if "max_pixels" in kw and "min_pixels" not in kw:
            kw["min_pixels"] = min(kw["max_pixels"], proc.min_pixels)
        self.processor = dataclasses.replace(proc, **kw)
        self.token, self.merge = model.image_token_id, model.spatial_merge_size

    @staticmethod
    def of(model, folder, hf_config: dict, args=None) -> Optional["ImageIntake"]:
        if getattr(model, "visual", None) is None:
            return None
        return ImageIntake(model, folder, hf_config, getattr(args, "mm_processor_kwargs", None),
                           getattr(args, "limit_mm_per_prompt", None))

    def check_count(self, n: int) -> None:
        if self.limit is not None and n > self.limit:
            raise ValueError(f"{n} images in one prompt; at most {self.limit} are taken (limit_mm_per_prompt)")

    def image(self, image) -> ImageInput:
        """A PIL image (or an ImageInput made earlier, as the server does off the engine thread)."""
        if isinstance(image, ImageInput):
            return image
        from PIL import Image
        if not isinstance(image, Image.Image):
            raise ValueError(f"an image must be a PIL.Image.Image, got {type(image).__name__}")
        return ImageInput.make(*self.processor(image), self.merge)

    def check_text(self, ids: list) -> None:
        """A prompt without images may not hold the image token: it would run as a text token."""
        if self.token in ids:
            raise ValueError(f"the prompt holds image placeholder tokens ({self.token}) but no images came with it")

    def attach(self, ids: list, images, params) -> tuple[list, PromptImages]:
        if getattr(params, "truncate_prompt_tokens", None) is not None:
            raise ValueError("truncate_prompt_tokens does not go with images (it could cut an image's tokens)")
        images = images if isinstance(images, (list, tuple)) else [images]
        self.check_count(len(images))
        return attach_images(ids, [self.image(im) for im in images], self.token, self.merge)
