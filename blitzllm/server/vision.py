"""Images and videos in chat requests (OpenAI's ``image_url`` and vLLM's ``video_url`` content
parts) for a model with a vision tower: each part loaded (a base64 data URL, or an http(s) URL
fetched) and made into the model's inputs in a worker thread, and the rendered prompt's
placeholders expanded to the items' token counts, so that the prompt's length, its usage and
the context checks count every image and video token. The chat template renders each part as
the model's placeholder (``chat_template.conversation``). A part's errors are 400s that name it.
"""
from __future__ import annotations

from ..engine.media import load_image_url, load_video_url
from .errors import bad_request

_KINDS = {"image_url": ("image", load_image_url), "video_url": ("video", load_video_url)}


def image_parts(messages) -> list:
    """(message index, part index, part) of each ``image_url`` / ``video_url`` part, in order."""
    return [(i, j, p) for i, m in enumerate(messages) if isinstance(getattr(m, "content", None), list)
            for j, p in enumerate(m.content) if p.type in _KINDS]


async def chat_images(s, messages) -> list:
    """The ``ImageInput``s and ``VideoInput``s of the messages' image and video parts (none: an empty list)."""
    parts = image_parts(messages)
    if not parts:
        return []
    intake = s.aengine.engine.image_intake if s.aengine.engine is not None else None
    i, j, _ = parts[0]
    if intake is None:
        raise bad_request("this model takes no images or videos (it has no vision tower): send text parts only",
                          param=f"messages.{i}.content.{j}")

    try:   # (before any part is read)
        for kind in ("image", "video"):
            intake.check_count(sum(_KINDS[p.type][0] == kind for _, _, p in parts), kind)
    except ValueError as e:
        raise bad_request(str(e), param="messages") from None

    def load() -> list:
        out = []
        for i, j, p in parts:
            ref = getattr(p, p.type)
            url = ref.get("url") if isinstance(ref, dict) else ref
            try:
                kw = {"sample": intake.video_processor.indices} if p.type == "video_url" else {}
                out.append(intake.media(_KINDS[p.type][1](url, domains=s.media_domains, **kw)))
            except ValueError as e:
                raise bad_request(f"messages.{i}.content.{j}.{p.type}: {e}",
                                  param=f"messages.{i}.content.{j}.{p.type}") from None
        return out

    return await s.cpu(load)


async def expand_images(s, ids: list, text: str, items: list) -> list:
    """The rendered prompt (``ids``, tokenized from ``text``) with each image and video placeholder
    expanded to its item's tokens; with videos, ``text`` is tokenized again with their frame groups
    written in (``ImageIntake.expand_text``: the timestamps tokenized with the text around them)."""
    intake = s.aengine.engine.image_intake
    written = intake.expand_text(text, items)
    if written != text:
        ids = await s.tokens(written, False)
    try:
        return intake.expand(ids, items)
    except ValueError as e:   # (a template that renders no placeholder for image parts)
        raise bad_request(f"the chat template's prompt does not place the images or videos: {e}",
                          param="messages") from None
