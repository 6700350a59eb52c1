"""Images and videos as clients send them (engine/media.py): data URLs decoded, what is refused
before any decoding or fetching (malformed base64, other schemes, hosts outside
--allowed-media-domains, too many pixels), a video file's frames and rate (PyAV), and a
conversation's image and video parts split out for the chat template."""
import base64
import io

import pytest
from PIL import Image

from blitzllm.engine.media import load_image_url, load_video_url, split_images


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
    with pytest.raises(ValueError, match="text, an image .* or a video"):
        split_images([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}])


def video_data_url(frames, fps: int, fmt: str = "matroska", codec: str = "ffv1", pix_fmt: str = "bgr0") -> str:
    """``frames`` ([T, H, W, 3] uint8) encoded by PyAV as a data URL; by default losslessly (FFV1)."""
    import av
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        stream = c.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], pix_fmt
        for f in frames:
            c.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        c.mux(stream.encode())
    return f"data:video/{fmt};base64," + base64.b64encode(buf.getvalue()).decode()


def test_video_urls_decode_and_split():
    """A lossless video's data URL decodes to its exact frames and rate; a video part of a
    conversation becomes {"type": "video"} with its Video beside, after the images before it;
    a file that is not a video and another scheme are refused."""
    import numpy as np
    frames = np.random.default_rng(0).integers(0, 256, (6, 10, 14, 3), dtype=np.uint8)
    url = video_data_url(frames, 5)
    video = load_video_url(url)
    assert np.array_equal(video.frames, frames) and video.fps == 5.0 and video.frames_indices is None
    img = Image.new("RGB", (4, 4))
    msgs = [{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                         {"type": "video_url", "video_url": {"url": url}},
                                         {"type": "video", "video": (frames[:4], {"fps": 2.0})},
                                         {"type": "text", "text": "Compare"}]}]
    out, items = split_images(msgs)
    assert out[0]["content"] == [{"type": "image"}, {"type": "video"}, {"type": "video"},
                                 {"type": "text", "text": "Compare"}]
    assert items[0] is img and np.array_equal(items[1].frames, frames)
    assert items[2].fps == 2.0 and items[2].frames.shape == (4, 10, 14, 3)
    for bad, msg in (("data:video/mp4;base64," + base64.b64encode(b"not a video").decode(), "could not be decoded"),
                     ("ftp://x/y.mp4", "unsupported video URL")):
        with pytest.raises(ValueError, match=msg):
            load_video_url(bad)


def test_video_file_keeps_only_the_sampled_frames():
    """With a sampler (the video processor's ``indices``), an MP4, whose container states its frame
    count, keeps only the sampled frames as they decode: the same arrays as decoding every frame
    and picking them, marked as sampled; a Matroska stream that states no count keeps all."""
    import numpy as np
    from blitzllm.engine.video import VideoProcessor
    frames = np.random.default_rng(1).integers(0, 256, (30, 16, 24, 3), dtype=np.uint8)
    mp4 = video_data_url(frames, 10, "mp4", "libx264", "yuv420p")
    whole = load_video_url(mp4)
    proc = VideoProcessor()
    want = proc.indices(30, 10.0)
    asked = []
    sampled = load_video_url(mp4, sample=lambda total, fps: asked.append((total, fps)) or want)
    assert asked == [(30, 10.0)] and sampled.frames_indices == tuple(want) and len(want) == 6
    assert np.array_equal(sampled.frames, whole.frames[want]) and sampled.fps == whole.fps
    mkv = load_video_url(video_data_url(frames[:8], 4), sample=lambda total, fps: [0])
    assert mkv.frames_indices is None and np.array_equal(mkv.frames, frames[:8])
