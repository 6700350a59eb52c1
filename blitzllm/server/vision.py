"""Images in chat requests (OpenAI's ``image_url`` content parts) for a model with a vision
tower: each part loaded (a base64 data URL, or an http(s) URL fetched) and made into the
model's inputs in a worker thread, and the rendered prompt's placeholders expanded to the
images' token counts, so that the prompt's length, its usage and the context checks count
every image token. The chat template renders each image part as the model's placeholder
(``chat_template.conversation``). A part's errors are 400s that name it.
"""
from __future__ import annotations

from ..engine.images import attach_images
from ..engine.media import load_image_url
from .errors import bad_request


def image_parts(messages) -> list:
    """(message index, part index, part) of each ``image_url`` part, in order."""
    return [(i, j, p) for i, m in enumerate(messages) if isinstance(getattr(m, "content", None), list)
            for j, p in enumerate(m.content) if p.type == "image_url"]


async def chat_images(s, messages) -> list:
    """The ``ImageInput``s of the messages' image parts (none: an empty list)."""
    parts = image_parts(messages)
    if not parts:
        return []
    intake = s.aengine.engine.image_intake if s.aengine.engine is not None else None
    i, j, _ = parts[0]
    if intake is None:
        raise bad_request("this model takes no images (it has no vision tower): send text parts only",
                          param=f"messages.{i}.content.{j}")

    try:
        intake.check_count(len(parts))   # (before any image is read)
    except ValueError as e:
        raise bad_request(str(e), param="messages") from None

    def load() -> list:
        out = []
        for i, j, p in parts:
            url = p.image_url.get("url") if isinstance(p.image_url, dict) else p.image_url
            try:
                out.append(intake.image(load_image_url(url, domains=s.media_domains)))
            except ValueError as e:
                raise bad_request(f"messages.{i}.content.{j}.image_url: {e}",
                                  param=f"messages.{i}.content.{j}.image_url") from None
        return out

    return await s.cpu(load)


def expand_images(s, ids: list, images: list) -> list:
    """The rendered prompt with each image placeholder expanded to its image's tokens."""
    intake = s.aengine.engine.image_intake
    try:
        return attach_images(ids, images, intake.token, intake.merge)[0]
    except ValueError as e:   # (a template that renders no placeholder for image parts)
        raise bad_request(f"the chat template's prompt does not place the images: {e}", param="messages") from None
