"""Images as clients send them (engine/media.py): data URLs decoded, what is refused before any
decoding or fetching (malformed base64, other schemes, hosts outside --allowed-media-domains,
too many pixels), and a conversation's image parts split out for the chat template."""
import base64
import io

import pytest
from PIL import Image

from blitzllm.engine.media import load_image_url, split_images


def _url(img, fmt="PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def test_data_urls_decode():
    img = Image.new("RGB", (7, 5), (10, 200, 30))
    for fmt in ("PNG", "JPEG", "WEBP"):
        out = load_image_url(_url(img, fmt))
        assert out.size == (7, 5) and out.convert("RGB").getpixel((3, 2))[1] > 150


@pytest.mark.parametrize("url, msg", [
    ("data:image/png;base64,@@", "malformed"), ("data:image/png,abc", "must be base64"),
    ("file:///etc/passwd", "unsupported image URL"), ("", "non-empty"),
    ("https://internal.example/x.png", "not one of --allowed-media-domains"),
    ("data:image/png;base64," + base64.b64encode(b"GIF89a junk").decode(), "could not be decoded")])
def test_refusals_before_any_fetch(url, msg):
    with pytest.raises(ValueError, match=msg):
        load_image_url(url, domains=("images.example.com",))


def test_too_many_pixels_refused_before_decoding():
    with pytest.raises(ValueError, match="9000x9000 pixels"):
        load_image_url(_url(Image.new("L", (9000, 9000))))


def test_split_images_for_the_template():
    """Image parts become {"type": "image"} items and their images come out in order; a message of
    text parts alone becomes one string, as the server joins parts; other parts are refused."""
    a, b = Image.new("RGB", (4, 4)), Image.new("RGB", (6, 2), (255, 0, 0))
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image_pil", "image_pil": a},
                                         {"type": "image_url", "image_url": {"url": _url(b)}}]},
            {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    out, images = split_images(msgs)
    assert out[1]["content"] == [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"}]
    assert out[2]["content"] == "one\ntwo" and out[0] == msgs[0]
    assert images[0] is a and images[1].size == (6, 2)
    with pytest.raises(ValueError, match="text or an image"):
        split_images([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}])
