"""Images through the engine on a multimodal Qwen3.5 folder (tiny, random, written by
transformers' save_pretrained with a vision tower): greedy tokens equal transformers' generate
on the same images (its own image processor, an independent oracle), with one image, two
images between text, a chunked prefill that cuts through an image, the prefix cache (same
image: hit; another image with the same placeholder tokens: no hit), and the refusals."""
import json

import pytest
import torch

from blitzllm import LLM, SamplingParams

IMG, VSTART, VEND = 300, 301, 302
PREPROCESS = {"size": {"shortest_edge": 256, "longest_edge": 4096}, "patch_size": 4, "temporal_patch_size": 2,
              "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def _checkpoint(path, moe: bool):
    import transformers
    from tests.models.test_qwen3_next import HYBRID, MOE, VISION
    torch.manual_seed(3)
    text = dict(MOE, **HYBRID) if moe else dict(HYBRID, intermediate_size=96)
    kw = dict(text_config=text, vision_config=VISION, image_token_id=IMG, vision_start_token_id=VSTART,
              vision_end_token_id=VEND)
    if moe:
        model = transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(**kw))
    else:
        model = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(**kw))
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("linear_attn.norm.weight"):
                t.normal_(1.0, 0.2)
            elif "norm" in name and "visual" not in name:
                t.normal_(0.0, 0.3)
    model = model.float().eval()
    model.save_pretrained(str(path), safe_serialization=True)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESS))
    return model


def _images(*sizes, seed=0):
    from PIL import Image
    g = torch.Generator().manual_seed(seed)
    return [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
            for w, h in sizes]


def _hf_greedy(hf, ids: list, images: list, n: int) -> list:
    """transformers' greedy tokens: its processor's pixels, the placeholders expanded as its processor does."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    proc = Qwen2VLImageProcessorPil(**PREPROCESS)
    batch = proc(images=images, return_tensors="pt")
    grids = batch["image_grid_thw"]
    out, k = [], 0
    for t in ids:
        if t == IMG:
            out += [IMG] * int(grids[k].prod() // 4)
            k += 1
        else:
            out.append(t)
    x = torch.tensor([out], device=hf.device)
    with torch.no_grad():
        gen = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), image_grid_thw=grids.to(x.device),
                          pixel_values=batch["pixel_values"].to(x.device), mm_token_type_ids=(x == IMG).int(),
                          max_new_tokens=n, do_sample=False)
    return gen[0, x.shape[1]:].tolist(), len(out)


@pytest.fixture(scope="module", params=["dense", "moe"])
def vl(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"qwen3_5_vl_{request.param}")
    hf = _checkpoint(path, request.param == "moe")
    llm = LLM(str(path), dtype="float32", kv_cache_blocks=64, max_num_seqs=4)
    yield hf, llm
    llm.engine.close()


def _prompt(n_images: int) -> list:
    ids = [5, 17, 42]
    for i in range(n_images):
        ids += [VSTART, IMG, VEND, 60 + i, 61 + i]
    return ids + [7, 8]


def test_greedy_matches_transformers(vl):
    """One image and two images (different sizes) with text around them: the tokens
    transformers generates, and the expanded prompt ids."""
    hf, llm = vl
    greedy = SamplingParams(temperature=0, max_tokens=6)
    for images in (_images((40, 24)), _images((33, 50), (64, 17), seed=1)):
        ids = _prompt(len(images))
        want, n_prompt = _hf_greedy(hf, ids, images, 6)
        out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, greedy)[0]
        assert out.outputs[0].token_ids == want
        assert len(out.prompt_token_ids) == n_prompt


def test_chunked_prefill_and_prefix_cache(vl):
    """A token budget of 16 cuts the prefill through the image; the same image again hits the prefix
    cache for whole blocks, another image with the same placeholders does not, and both answers are
    transformers'."""
    hf, first = vl
    llm = LLM(first.engine.args.model, dtype="float32", kv_cache_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=16, block_size=4)
    greedy = SamplingParams(temperature=0, max_tokens=5)
    a, b = _images((48, 40), seed=2)[0], _images((48, 40), seed=3)[0]
    ids = _prompt(1)
    for img, hit in ((a, False), (a, True), (b, False)):
        want, n_prompt = _hf_greedy(hf, ids, [img], 5)
        before = llm.stats()["prefix_cache_hit_tokens"]
        out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": img}}, greedy)[0]
        assert out.outputs[0].token_ids == want
        gained = llm.stats()["prefix_cache_hit_tokens"] - before
        assert (gained >= n_prompt - 4) if hit else gained <= 4   # (the 4 tokens before the image)
    assert llm.stats()["kv_blocks_free"] == 64
    llm.engine.close()


def test_speculation_keeps_the_tokens(vl):
    """n-gram speculation over an image prompt (verify steps run as forwards with the rotary
    positions past the image): transformers' greedy tokens, every block back."""
    hf, first = vl
    llm = LLM(first.engine.args.model, dtype="float32", kv_cache_blocks=64, max_num_seqs=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    images = _images((40, 32), seed=7)
    ids = _prompt(1) + list(range(20, 300))   # (most tokens in the prompt: the proposer finds matches)
    want, _ = _hf_greedy(hf, ids, images, 10)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
                       SamplingParams(temperature=0, max_tokens=10))[0]
    assert out.outputs[0].token_ids == want and llm.stats()["kv_blocks_free"] == 64
    assert llm.stats()["spec_draft_tokens"] > 0
    llm.engine.close()


def test_warm_up_sends_no_placeholders(vl, monkeypatch):
    """The CUDA start-up's warm-up (its random prompts run here on the CPU, its one device sync
    skipped): no random token is the image placeholder, which a prompt without images may not
    hold (it stopped a GPU start)."""
    from blitzllm.engine.warmup import warm_up
    _, llm = vl
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    warm_up(llm.engine)
    assert llm.stats()["kv_blocks_free"] == 64


def test_processor_bounds_and_image_limit(vl):
    """vLLM's mm_processor_kwargs cap an image's pixels (256 here: the tokens transformers' processor
    gives with that bound) and limit_mm_per_prompt the images of a prompt; bad values are
    ValueErrors at start-up."""
    hf, first = vl
    path = first.engine.args.model
    llm = LLM(path, dtype="float32", kv_cache_blocks=64, mm_processor_kwargs={"max_pixels": 256},
              limit_mm_per_prompt='{"image": 1}')
    img = _images((64, 48), seed=8)
    out = llm.generate({"prompt_token_ids": _prompt(1), "multi_modal_data": {"image": img}},
                       SamplingParams(temperature=0, max_tokens=3))[0]
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    capped = Qwen2VLImageProcessorPil(**{**PREPROCESS, "size": {"shortest_edge": 256, "longest_edge": 256}})
    assert out.prompt_token_ids.count(IMG) == int(capped(images=img, return_tensors="pt")["image_grid_thw"].prod()) // 4
    with pytest.raises(ValueError, match="at most 1"):
        llm.generate({"prompt_token_ids": _prompt(2), "multi_modal_data": {"image": img * 2}})
    llm.engine.close()
    for kw, msg in ((dict(mm_processor_kwargs={"max_pixels": 0}), "positive"),
                    (dict(mm_processor_kwargs={"size": 3}), "takes min_pixels"),
                    (dict(limit_mm_per_prompt={"audio": 1}), "takes 'image' and 'video'"),
                    (dict(mm_processor_kwargs="{"), "must be a JSON object")):
        with pytest.raises(ValueError, match=msg):
            LLM(path, dtype="float32", kv_cache_blocks=64, **kw)


def test_refusals(vl):
    """Placeholders and images that do not pair up, a non-image, truncation and embeddings are
    ValueErrors naming the problem; the engine serves the next request."""
    _, llm = vl
    img = _images((16, 16))[0]
    cases = [({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": img}}, "0 image placeholder"),
             ({"prompt_token_ids": [1, IMG, 2], "multi_modal_data": {"image": [img, img]}}, "1 image placeholder"),
             ({"prompt_token_ids": [1, IMG], "multi_modal_data": {"image": "x.png"}}, "PIL"),
             ({"prompt_token_ids": [1, IMG], "multi_modal_data": {"audio": img}}, "takes 'image'"),
             ({"prompt_token_ids": [1, IMG], "multi_modal_data": {"video": img}}, "uint8 RGB frames"),
             ([1, IMG, 2], "no images came")]
    for prompt, msg in cases:
        with pytest.raises(ValueError, match=msg):
            llm.generate(prompt, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate({"prompt_token_ids": [1, IMG], "multi_modal_data": {"image": img}},
                     SamplingParams(max_tokens=2, truncate_prompt_tokens=3))
    out = llm.generate({"prompt_token_ids": [1, IMG, 2], "multi_modal_data": {"image": img}},
                       SamplingParams(max_tokens=2, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 2 and llm.stats()["kv_blocks_free"] == 64


@pytest.mark.gpu
@pytest.mark.parametrize("moe", [False, True])
def test_images_on_cuda_match_transformers(tmp_path, moe):
    """fp32 on CUDA with the decode graphs captured: a chunk with image tokens runs the fused
    rotary + cache kernel on M-RoPE rows, decode steps (graphs) use index + delta; transformers'
    greedy tokens (its model on the GPU too: fla's chunked rule takes its fp32 dots in TF32 on both
    sides), whole and in 16-token chunks, and no KV left held."""
    hf = _checkpoint(tmp_path, moe).to("cuda")
    images = _images((33, 50), (64, 17), seed=4)
    ids = _prompt(2)
    want, n_prompt = _hf_greedy(hf, ids, images, 8)
    del hf
    for kw in (dict(), dict(max_num_batched_tokens=16)):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_blocks=64, max_num_seqs=4, **kw)
        assert llm.engine.runner.graphs is not None
        out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
                           SamplingParams(temperature=0, max_tokens=8))[0]
        assert out.outputs[0].token_ids == want and len(out.prompt_token_ids) == n_prompt
        assert llm.stats()["kv_blocks_free"] == 64
        llm.engine.close()


def test_tensor_parallel_matches_transformers(vl):
    """tensor_parallel_size=2 on the CPU (gloo): rank 0 runs the vision tower and hands every
    rank the step's image rows and rotary positions; one and two images, and a prefill of
    16-token chunks that cuts through an image, give transformers' tokens; nothing stays held."""
    from tests.conftest import hf_greedy
    hf, first = vl
    greedy = SamplingParams(temperature=0, max_tokens=5, logprobs=0)
    with LLM(first.engine.args.model, device="cpu", dtype="float32", kv_cache_blocks=64, max_num_seqs=4,
             tensor_parallel_size=2, max_num_batched_tokens=16, block_size=4) as llm:
        assert llm.engine.tp is not None
        for images in (_images((40, 24), seed=5), _images((33, 50), (64, 17), seed=6)):
            ids = _prompt(len(images))
            want, n_prompt = _hf_greedy(hf, ids, images, 5)
            prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
            out = llm.generate(prompt, greedy)[0]
            assert out.outputs[0].token_ids == want and len(out.prompt_token_ids) == n_prompt
            # the logprobs too (an image's rows counted once in the ranks' sum, not once per rank)
            one = first.generate(prompt, greedy)[0].outputs[0]
            lps = [torch.tensor([lp[t] for lp, t in zip(o.logprobs, o.token_ids)]) for o in (out.outputs[0], one)]
            torch.testing.assert_close(lps[0], lps[1], atol=1e-4, rtol=1e-4)
        text = llm.generate([_prompt(0)], greedy)[0]   # (a text prompt beside: positions are indices)
        assert text.outputs[0].token_ids == hf_greedy(hf, _prompt(0), 5)
        assert llm.stats()["kv_blocks_free"] == 64
