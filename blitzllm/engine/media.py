"""Images and videos as clients send them: OpenAI's ``image_url`` content parts (a ``data:`` URL
with base64 bytes, or an http(s) URL fetched here), vLLM's ``image_pil`` parts and PIL images,
vLLM's ``video_url`` parts (decoded with PyAV) and frames; and a conversation's parts turned
into what chat templates take (``{"type": "image"}`` / ``{"type": "video"}`` items, the images
and videos in order beside). Errors are ValueErrors that say what is wrong with the
part, which the server answers as 400s.
"""
from __future__ import annotations

import base64
import binascii
import io
import urllib.parse

MAX_IMAGE_BYTES = 20 * 1024 * 1024   # an encoded image, fetched or inline
MAX_IMAGE_PIXELS = 8192 * 8192      # decoded (a small file can hold a huge image: checked before decoding)
MAX_VIDEO_BYTES = 100 * 1024 * 1024
MAX_VIDEO_PIXELS = 1 << 28           # all decoded frames together (3 bytes each)
FETCH_TIMEOUT_S = 10.0
IMAGE_PART_TYPES = ("image_url", "input_image", "image_pil", "image")
VIDEO_PART_TYPES = ("video_url", "video")


def open_image(data: bytes):
    """Encoded bytes -> an RGB-or-other PIL image, fully read (a truncated or non-image file is a ValueError)."""
    from PIL import Image, UnidentifiedImageError
    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > MAX_IMAGE_PIXELS:
            raise ValueError(f"{img.width}x{img.height} pixels, over the {MAX_IMAGE_PIXELS} taken")
        img.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"the image could not be decoded: {e}") from None
    return img


def open_video(data: bytes, sample=None):
    """Encoded bytes (mp4, webm, ...) -> a ``Video``: RGB frames and the stream's frame rate,
    decoded with PyAV (the ``video`` extra). ``sample(total, fps)`` -> frame indices (the video
    processor's ``indices``): where the container states its frame count, only those frames are
    kept as they decode (the Video then carries them as sampled), else every frame."""
    import numpy as np
    from .video import Video
    try:
        import av
    except ImportError:
        raise ValueError("video input needs PyAV on the server: pip install av") from None
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise ValueError("the file has no video stream")
            stream = container.streams.video[0]
            fps, count = float(stream.average_rate) if stream.average_rate else None, stream.frames
            want = sample(count, fps) if sample is not None and count > 0 else None
            kept, total = _decode(container.decode(stream), None if want is None else set(want))
        if want is not None and total != count:   # (a count the stream did not keep: all of it)
            with av.open(io.BytesIO(data)) as container:
                want, (kept, total) = None, _decode(container.decode(container.streams.video[0]), None)
    except (getattr(av, "FFmpegError", OSError), OSError, ValueError, IndexError) as e:
        raise ValueError(f"the video could not be decoded: {e}") from None
    if not kept:
        raise ValueError("the video could not be decoded: it has no frames")
    if want is None:
        return Video(np.stack([kept[i] for i in range(total)]), fps)
    return Video(np.stack([kept[i] for i in want]), fps, tuple(want))


def _decode(frames, keep) -> tuple[dict, int]:
    """({index: RGB array} of the decoded frames in ``keep`` (None: all), the frames decoded)."""
    out, pixels, total = {}, 0, 0
    for i, frame in enumerate(frames):
        total = i + 1
        if keep is not None and i not in keep:
            continue
        pixels += frame.width * frame.height
        if pixels > MAX_VIDEO_PIXELS:
            raise ValueError(f"the decoded video is over {MAX_VIDEO_PIXELS} pixels (the frames kept together)")
        out[i] = frame.to_ndarray(format="rgb24")
    return out, total


def _url_bytes(url: str, what: str, limit: int, allow_fetch: bool, domains: tuple) -> bytes:
    """The bytes of a ``data:<what>/...;base64,...`` URL or (``allow_fetch``) an http(s) one;
    ``domains``: when given, the only hosts fetched from (the server's --allowed-media-domains)."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"an {what} URL must be a non-empty string")
    if url.startswith("data:"):
        head, sep, body = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ValueError(f"a data URL {what} must be base64: data:{what}/<type>;base64,<data>")
        if len(body) > limit * 4 // 3 + 4:
            raise ValueError(f"the {what} is over {limit} bytes")
        try:
            return base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("the data URL's base64 is malformed") from None
    if url.startswith(("http://", "https://")):
        if not allow_fetch:
            raise ValueError(f"{what} URLs are not fetched here: send the {what} inline as a data URL")
        host = urllib.parse.urlsplit(url).hostname or ""
        if domains and host not in domains:
            raise ValueError(f"the {what} URL's host {host!r} is not one of --allowed-media-domains")
        return _fetch(url, what, limit)
    raise ValueError(f"unsupported {what} URL {url[:40]!r}: give a data:{what}/...;base64 URL or an http(s) URL")


def load_image_url(url: str, allow_fetch: bool = True, domains: tuple = ()):
    """An image's data or http(s) URL (``_url_bytes``) -> a PIL image."""
    return open_image(_url_bytes(url, "image", MAX_IMAGE_BYTES, allow_fetch, domains))


def load_video_url(url: str, allow_fetch: bool = True, domains: tuple = (), sample=None):
    """A video's data or http(s) URL (``_url_bytes``) -> a ``Video`` (``open_video``, ``sample``)."""
    return open_video(_url_bytes(url, "video", MAX_VIDEO_BYTES, allow_fetch, domains), sample)


def _fetch(url: str, what: str, limit: int) -> bytes:
    import httpx
    try:
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=True) as r:
            if r.status_code != 200:
                raise ValueError(f"fetching the {what} gave HTTP {r.status_code}")
            data = bytearray()
            for chunk in r.iter_bytes():
                data += chunk
                if len(data) > limit:
                    raise ValueError(f"the {what} is over {limit} bytes")
            return bytes(data)
    except httpx.HTTPError as e:
        raise ValueError(f"the {what} URL could not be fetched: {type(e).__name__}: {e}") from None


def part_image(part: dict, allow_fetch: bool = True):
    """One image content part (OpenAI's ``image_url`` / Responses' ``input_image`` / vLLM's
    ``image_pil`` / a ``{"type": "image", "image": PIL image}``) -> its PIL image."""
    kind = part.get("type")
    if kind == "image_url":
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        return load_image_url(url, allow_fetch)
    if kind == "input_image":
        return load_image_url(part.get("image_url"), allow_fetch)
    from PIL import Image
    img = part.get(kind)
    if not isinstance(img, Image.Image):
        raise ValueError(f"a {kind!r} part's {kind!r} must be a PIL image")
    return img


def part_video(part: dict, allow_fetch: bool = True, sample=None):
    """One video content part (vLLM's ``video_url``, or ``{"type": "video", "video": frames}`` with
    frames as ``engine/video.py``'s ``as_video`` takes them) -> its ``Video`` (``sample``: as
    ``open_video``'s)."""
    from .video import as_video
    if part.get("type") == "video_url":
        ref = part.get("video_url")
        return load_video_url(ref.get("url") if isinstance(ref, dict) else ref, allow_fetch, sample=sample)
    return as_video(part.get("video"))


def split_images(messages: list, allow_fetch: bool = True, video_sample=None) -> tuple[list, list]:
    """(messages for the chat template, their images and videos in order): a message whose content
    is a list of parts keeps its text parts and has each image part as ``{"type": "image"}`` and
    each video part as ``{"type": "video"}``, which the templates of vision models render as the
    placeholders; a list of text parts alone becomes their text joined by newlines, as the server
    joins them. ``video_sample``: the frames a video file keeps as it decodes (``open_video``)."""
    out, images = [], []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                images.append(part_image(part, allow_fetch))
                parts.append({"type": "image"})
            elif isinstance(part, dict) and part.get("type") in VIDEO_PART_TYPES:
                images.append(part_video(part, allow_fetch, video_sample))
                parts.append({"type": "video"})
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise ValueError(f"a content part must be text, an image ({', '.join(IMAGE_PART_TYPES)}) or a video "
                                 f"({', '.join(VIDEO_PART_TYPES)}), "
                                 f"got type {part.get('type') if isinstance(part, dict) else part!r:.40}")
        if all(p["type"] == "text" for p in parts):   # (text-only templates take a string)
            parts = "\n".join(p["text"] for p in parts)
        out.append({**m, "content": parts})
    return out, images
