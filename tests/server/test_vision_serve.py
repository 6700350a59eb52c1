"""Images and videos in chat on a tiny random multimodal Qwen3.5 (``tests/models/test_qwen3_5_video.py``'s
``tiny_vl``: SmolLM2's tokenizer plus Qwen's vision tokens and a ChatML template that renders
image and video parts as Qwen's placeholders, as Qwen3.5's published template does): ``LLM.chat``
and ``blitz serve``'s /v1/chat/completions (plain and streamed; the OpenAI client's
``image_url`` parts with base64 data URLs, vLLM's ``video_url`` parts with an MP4) answer what
transformers generates for the same image or video with its own processors; usage counts every
image and frame token; bad parts are 400s that name the part, an image or a video for a
text-only model is a 400, and the server keeps serving."""
from __future__ import annotations

import base64
import io

import httpx
import pytest
import torch

from tests.engine.test_media import video_data_url
from tests.models.test_qwen3_5_video import IMAGE_PREPROCESS as PREPROCESS
from tests.models.test_qwen3_5_video import hf_greedy, tiny_vl, transformers_video_processor
from tests.server.conftest import ServerProcess, running
from tests.server.server_helpers import check_error, stream_chat

def _png(w, h, seed) -> str:
    from PIL import Image
    g = torch.Generator().manual_seed(seed)
    img = Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _huge_png() -> str:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("L", (9000, 9000)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(*urls, text="What is in the picture?"):
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def _hf_answer(hf, tok, messages, n: int) -> tuple:
    """(transformers' greedy text, the expanded prompt's length): its own processor on the images."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    urls = [p["image_url"]["url"] for p in messages[0]["content"] if p["type"] == "image_url"]
    images = [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))) for u in urls]
    batch = Qwen2VLImageProcessorPil(**PREPROCESS)(images=images, return_tensors="pt")
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    ids, k = [], 0
    for t in tok(text, add_special_tokens=False).input_ids:
        ids += [pad] * int(batch["image_grid_thw"][k].prod() // 4) if t == pad else [t]
        k += t == pad
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=batch["pixel_values"],
                          image_grid_thw=batch["image_grid_thw"], mm_token_type_ids=(x == pad).int(),
                          max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True), len(ids)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_vl_serve")
    hf, tok = tiny_vl(folder)
    srv = ServerProcess(["--model", str(folder), "--dtype", "float32", "--served-model-name", "vl",
                         "--max-model-len", "1024", "--allowed-media-domains", "images.example.com",
                         "--limit-mm-per-prompt", '{"image": 2, "video": 1}'],
                        folder / "server.log")
    for s in running(srv):
        yield hf, tok, folder, s


def _post(srv, body):
    return httpx.post(srv.url + "/v1/chat/completions", json={"max_tokens": 8, "temperature": 0, **body}, timeout=120)


def test_chat_with_images_matches_transformers(vl):
    """One image, then two of other sizes: the server's answer (plain and streamed) and
    ``LLM.chat``'s are transformers' text; usage counts the expanded prompt."""
    from blitzllm import LLM, SamplingParams
    hf, tok, folder, srv = vl
    llm = LLM(str(folder), dtype="float32", kv_cache_blocks=128, max_num_seqs=2)
    try:
        for messages in (_messages(_png(40, 24, 0)), _messages(_png(33, 50, 1), _png(64, 17, 2), text="Compare.")):
            want, n_prompt = _hf_answer(hf, tok, messages, 8)
            body = _post(srv, {"messages": messages}).json()
            assert body["choices"][0]["message"]["content"] == want
            assert body["usage"]["prompt_tokens"] == n_prompt
            tokens = httpx.post(srv.url + "/tokenize", json={"messages": messages}, timeout=60).json()
            assert tokens["count"] == n_prompt   # (/tokenize expands the images as chat does)
            parts, _, _ = stream_chat(srv.url, {"messages": messages, "max_tokens": 8, "temperature": 0,
                                                "stream": True})
            assert parts["content"] == want
            out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8))[0]
            assert out.outputs[0].text == want and len(out.prompt_token_ids) == n_prompt
    finally:
        llm.engine.close()


def _decoded(url: str) -> tuple:
    """(frames, fps) of a video data URL as PyAV decodes it (what the server reads: the codec is lossy)."""
    import av
    import numpy as np
    with av.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as c:
        stream = c.streams.video[0]
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(stream)]), float(stream.average_rate)


def test_chat_with_video_matches_transformers(vl):
    """vLLM's ``video_url`` part (an MP4 as a base64 data URL) beside text: the answer (plain and
    streamed) is transformers' on the frames PyAV decodes, sampled at 2 fps by its video processor,
    with the timestamps its processor writes; usage and /tokenize count every frame group's token.
    A video that does not decode and a second video over --limit-mm-per-prompt are 400s naming the
    part (or field)."""
    import numpy as np
    hf, tok, folder, srv = vl
    url = video_data_url(np.random.default_rng(4).integers(0, 256, (20, 32, 48, 3), dtype=np.uint8), 8, "mp4",
                         "libx264", "yuv420p")
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "What happens?"}]}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    frames, fps = _decoded(url)
    with transformers_video_processor() as proc:
        want, want_ids = hf_greedy(hf, tok, prompt, [(frames, {"fps": fps})], proc, 8)
    body = _post(srv, {"messages": messages}).json()
    assert body["choices"][0]["message"]["content"] == tok.decode(want, skip_special_tokens=True)
    assert body["usage"]["prompt_tokens"] == len(want_ids)
    assert httpx.post(srv.url + "/tokenize", json={"messages": messages}, timeout=60).json()["tokens"] == want_ids
    parts, _, _ = stream_chat(srv.url, {"messages": messages, "max_tokens": 8, "temperature": 0, "stream": True})
    assert parts["content"] == body["choices"][0]["message"]["content"]
    bad = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(b"nope").decode()}}]
    err = check_error(_post(srv, {"messages": [{"role": "user", "content": bad}]}), 400,
                      "messages.0.content.0.video_url")
    assert "could not be decoded" in err["message"]
    two = [{"role": "user", "content": messages[0]["content"][:1] * 2}]
    assert "at most 1" in check_error(_post(srv, {"messages": two}), 400, "messages")["message"]
    assert _post(srv, {"messages": messages}).status_code == 200


def test_bad_image_parts_are_400s(vl):
    """A malformed data URL, an unsupported scheme, a non-image file, an image of too many pixels, a
    host outside --allowed-media-domains, use_beam_search with an image and more images than
    --limit-mm-per-prompt are 400s naming the part (or field); then the server still answers."""
    *_, srv = vl
    bad = [("data:image/png;base64,@@@", "malformed"), ("ftp://example.com/x.png", "unsupported image URL"),
           ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "could not be decoded"),
           (_huge_png(), "over the"), ("http://127.0.0.1:9/x.png", "allowed-media-domains")]   # (80 kB of PNG, 81M pixels: refused before decoding)
    for url, msg in bad:
        err = check_error(_post(srv, {"messages": _messages(url)}), 400, "messages.0.content.0.image_url")
        assert msg in err["message"]
    check_error(_post(srv, {"messages": _messages(_png(16, 16, 0)), "use_beam_search": True, "n": 2}), 400,
                "use_beam_search")
    err = check_error(_post(srv, {"messages": _messages(*[_png(16, 16, i) for i in range(3)])}), 400, "messages")
    assert "at most 2" in err["message"]   # (--limit-mm-per-prompt)
    assert _post(srv, {"messages": _messages(_png(16, 16, 3))}).status_code == 200


def test_text_model_refuses_images(smol_server):
    err = check_error(_post(smol_server, {"messages": _messages(_png(16, 16, 0))}), 400, "messages.0.content.0")
    assert "no images" in err["message"]
    video = [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                          {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}]
    err = check_error(_post(smol_server, {"messages": video}), 400, "messages.0.content.1")
    assert "no images or videos" in err["message"]


def test_responses_input_image(vl):
    """The Responses API's input_image parts: the answer equals chat completions' for the same
    image and text; an input_image without image_url is a 400 naming it."""
    *_, srv = vl
    url = _png(40, 24, 5)
    chat = _post(srv, {"messages": _messages(url)}).json()["choices"][0]["message"]["content"]
    body = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                                   {"type": "input_text", "text": "What is in the picture?"}]}],
            "max_output_tokens": 8, "temperature": 0}
    r = httpx.post(srv.url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    text = "".join(c["text"] for item in out if item["type"] == "message" for c in item["content"])
    assert text == chat
    body["input"][0]["content"][0] = {"type": "input_image", "file_id": "file-1"}
    check_error(httpx.post(srv.url + "/v1/responses", json=body, timeout=60), 400, "input.0.content.0")


def test_messages_image_block(vl):
    """Anthropic's image blocks (base64 source) on /v1/messages: the answer equals chat completions'
    for the same image and text; a source of another type is a 400 naming it."""
    *_, srv = vl
    url = _png(24, 40, 6)
    chat = _post(srv, {"messages": _messages(url)}).json()["choices"][0]["message"]["content"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}}
    body = {"model": "vl", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": "What is in the picture?"}]}]}
    r = httpx.post(srv.url + "/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert "".join(b["text"] for b in r.json()["content"] if b["type"] == "text") == chat
    counted = httpx.post(srv.url + "/v1/messages/count_tokens", json=body, timeout=60).json()["input_tokens"]
    assert counted == r.json()["usage"]["input_tokens"] > 20   # (the image's tokens counted)
    image["source"] = {"type": "file", "file_id": "f"}
    r = httpx.post(srv.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and "source" in r.json()["error"]["message"]
