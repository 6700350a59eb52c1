"""Images as clients send them: OpenAI's ``image_url`` content parts (a ``data:`` URL with
base64 bytes, or an http(s) URL fetched here), vLLM's ``image_pil`` parts and PIL images;
and a conversation's image parts turned into what chat templates take (``{"type": "image"}``
items, the images in order beside). Errors are ValueErrors that say what is wrong with the
part, which the server answers as 400s.
"""
from __future__ import annotations

import base64
import binascii
import io
import urllib.parse

MAX_IMAGE_BYTES = 20 * 1024 * 1024   # an encoded image, fetched or inline
MAX_IMAGE_PIXELS = 8192 * 8192      # decoded (a small file can hold a huge image: checked before decoding)
FETCH_TIMEOUT_S = 10.0
IMAGE_PART_TYPES = ("image_url", "input_image", "image_pil", "image")


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


def load_image_url(url: str, allow_fetch: bool = True, domains: tuple = ()):
    """A ``data:image/...;base64,...`` URL or (``allow_fetch``) an http(s) one -> a PIL image;
    ``domains``: when given, the only hosts fetched from (the server's --allowed-media-domains)."""
    if not isinstance(url, str) or not url:
        raise ValueError("an image URL must be a non-empty string")
    if url.startswith("data:"):
        head, sep, body = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ValueError("a data URL image must be base64: data:image/<type>;base64,<data>")
        if len(body) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise ValueError(f"the image is over {MAX_IMAGE_BYTES} bytes")
        try:
            data = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("the data URL's base64 is malformed") from None
        return open_image(data)
    if url.startswith(("http://", "https://")):
        if not allow_fetch:
            raise ValueError("image URLs are not fetched here: send the image inline as a data URL")
        host = urllib.parse.urlsplit(url).hostname or ""
        if domains and host not in domains:
            raise ValueError(f"the image URL's host {host!r} is not one of --allowed-media-domains")
        return open_image(_fetch(url))
    raise ValueError(f"unsupported image URL {url[:40]!r}: give a data:image/...;base64 URL or an http(s) URL")


def _fetch(url: str) -> bytes:
    import httpx
    try:
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=True) as r:
            if r.status_code != 200:
                raise ValueError(f"fetching the image gave HTTP {r.status_code}")
            data = bytearray()
            for chunk in r.iter_bytes():
                data += chunk
                if len(data) > MAX_IMAGE_BYTES:
                    raise ValueError(f"the image is over {MAX_IMAGE_BYTES} bytes")
            return bytes(data)
    except httpx.HTTPError as e:
        raise ValueError(f"the image URL could not be fetched: {type(e).__name__}: {e}") from None


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


def split_images(messages: list, allow_fetch: bool = True) -> tuple[list, list]:
    """(messages for the chat template, their images in order): a message whose content is a list
    of parts keeps its text parts and has each image part as ``{"type": "image"}``, which the
    templates of vision models render as the image's placeholder; a list of text parts alone
    becomes their text joined by newlines, as the server joins them."""
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
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise ValueError(f"a content part must be text or an image ({', '.join(IMAGE_PART_TYPES)}), "
                                 f"got type {part.get('type') if isinstance(part, dict) else part!r:.40}")
        if all(p["type"] == "text" for p in parts):   # (text-only templates take a string)
            parts = "\n".join(p["text"] for p in parts)
        out.append({**m, "content": parts})
    return out, images
