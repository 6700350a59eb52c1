"""Sequence classifiers (``*ForSequenceClassification``) against transformers on the same tiny
random checkpoints: ``LLM.classify``'s probabilities are the softmax of transformers' logits (the
sigmoid with one label), in one batch of prompts of several lengths and through chunked
prefill; with one label (a cross-encoder) ``LLM.score`` is the sigmoid of the logit of the
tokenizer's pair encoding. Such a model classifies and scores only: generation and embeddings
are refused, and classification on a causal LM is refused.

float32 on the CPU: the two implementations differ in summation order only (~1e-7)."""
import pytest
import torch

from blitzllm import LLM, ClassificationRequestOutput, PoolingParams, SamplingParams
from tests.classifiers import LABELS, hf_logits, make_tiny_classifier

TOL = 1e-4
LONG = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat . " * 4  # 72 tokens
PROMPTS = [LONG, "hello", "what is the capital of france ?", [5, 9, 13, 21, 34]]
# (transformers rebuilds a qwen2 folder's tokenizer as Qwen2Tokenizer, which our word-level one is not:
# that model gets token ids)
ID_PROMPTS = [[(7 * i) % 300 + 3 for i in range(72)], [9], [1, 4, 5, 6, 7, 8, 9, 61], [5, 9, 13, 21, 34]]
QUERY = "what is the capital of france ?"
DOCS = ["paris is the capital of france .", "bananas are yellow and sweet .", "the eiffel tower stands in paris ."]

_MADE = {}


@pytest.fixture(scope="module", autouse=True)
def _drop_models():
    yield
    _MADE.clear()


def classifier(tmp_path_factory, arch: str, num_labels: int):
    """(folder, transformers model) of a tiny classifier, made once per session."""
    key = (arch, num_labels)
    if key not in _MADE:
        path = tmp_path_factory.mktemp(f"tiny-{arch}-cls{num_labels}")
        _MADE[key] = path, make_tiny_classifier(arch, path, num_labels)
    return _MADE[key]


def no_leaks(llm: LLM) -> None:
    e = llm.engine
    assert not e.has_unfinished() and not e.requests
    assert e.kv.num_free_blocks == e.kv.num_blocks


def close(got: list, want: torch.Tensor) -> bool:
    got = torch.tensor(got)
    return got.shape == want.shape and torch.allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_classify_is_the_softmax_of_transformers_logits_batched_and_chunked(tmp_path_factory, arch):
    path, hf = classifier(tmp_path_factory, arch, 3)
    whole = LLM(str(path), device="cpu", dtype="float32")
    chunked = LLM(str(path), device="cpu", dtype="float32", max_num_batched_tokens=16, max_model_len=256)
    assert whole.engine.model_config.labels == tuple(LABELS.values())
    prompts = ID_PROMPTS if arch == "qwen2" else PROMPTS
    assert len(chunked.tokenize(prompts[0])) > 4 * 16   # (five chunks at least)
    for llm in (whole, chunked):
        outs = llm.classify(prompts)
        for p, o in zip(prompts, outs):
            assert isinstance(o, ClassificationRequestOutput) and o.finished
            assert o.prompt_token_ids == llm.tokenize(p)
            assert o.outputs.num_classes == 3
            assert close(o.outputs.probs, hf_logits(hf, o.prompt_token_ids).softmax(-1)), (arch, p)
        assert len({tuple(round(x, 4) for x in o.outputs.probs) for o in outs}) >= 3   # (rows told apart)
        no_leaks(llm)


def test_classify_options_and_the_prefix_cache(tmp_path_factory):
    path, hf = classifier(tmp_path_factory, "qwen3", 3)
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_batched_tokens=16, max_model_len=256)
    ids = llm.tokenize(LONG)
    raw = llm.classify(LONG, PoolingParams(use_activation=False))[0]
    assert close(raw.outputs.probs, hf_logits(hf, ids))
    cut = llm.classify(LONG, PoolingParams(truncate_prompt_tokens=10))[0]
    assert cut.prompt_token_ids == ids[-10:]
    assert close(cut.outputs.probs, hf_logits(hf, ids[-10:]).softmax(-1))
    hits = llm.stats()["prefix_cache_hit_tokens"]   # (LAST pooling takes a prefix-cache hit)
    again = llm.classify(LONG)[0]
    assert llm.stats()["prefix_cache_hit_tokens"] > hits
    assert close(again.outputs.probs, hf_logits(hf, ids).softmax(-1))
    no_leaks(llm)


def test_a_classifier_neither_generates_nor_embeds(tmp_path_factory):
    path, _ = classifier(tmp_path_factory, "qwen3", 3)
    llm = LLM(str(path), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="sequence classifier \\(Qwen3ForSequenceClassification\\).*not generate"):
        llm.generate("hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="Qwen3ForSequenceClassification.*not embed"):
        llm.embed("hello")
    with pytest.raises(ValueError, match="has 3 labels: scoring text pairs needs a classifier of one label"):
        llm.score(QUERY, DOCS)
    with pytest.raises(ValueError, match="dimensions and normalize are for embeddings"):
        llm.classify("hello", PoolingParams(normalize=True))
    no_leaks(llm)


def test_a_causal_lm_does_not_classify(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(str(path), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="the classify task needs a sequence classifier"):
        llm.classify([[5, 6, 7]])
    no_leaks(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cross_encoder_score_is_the_sigmoid_of_the_pair_encoding(tmp_path_factory, arch):
    path, hf = classifier(tmp_path_factory, arch, 1)
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_batched_tokens=8, max_model_len=128)
    tok = llm.tokenizer

    def want(a: str, b: str) -> float:
        ids = tok(a, b).input_ids
        assert ids != tok(a).input_ids + tok(b).input_ids[1:]   # (not a concatenation: a separator between)
        return float(hf_logits(hf, ids).sigmoid()[0])

    one_to_many = llm.score(QUERY, DOCS)
    assert [o.outputs.score for o in one_to_many] == pytest.approx([want(QUERY, d) for d in DOCS], abs=TOL)
    assert len({round(o.outputs.score, 4) for o in one_to_many}) == 3
    assert one_to_many[0].prompt_token_ids == tok(QUERY, DOCS[0]).input_ids
    pairwise = llm.score(DOCS, DOCS[::-1])
    assert [o.outputs.score for o in pairwise] == pytest.approx([want(a, b) for a, b in zip(DOCS, DOCS[::-1])],
                                                                abs=TOL)
    cut = llm.score(QUERY, DOCS[0], truncate_prompt_tokens=6)[0]
    assert cut.prompt_token_ids == tok(QUERY, DOCS[0]).input_ids[-6:]
    assert cut.outputs.score == pytest.approx(float(hf_logits(hf, cut.prompt_token_ids).sigmoid()[0]), abs=TOL)
    # classify on it: the same head and activation, one "class"
    (c,) = llm.classify(QUERY)
    assert c.outputs.num_classes == 1
    assert close(c.outputs.probs, hf_logits(hf, llm.tokenize(QUERY)).sigmoid())
    with pytest.raises(ValueError, match="must be texts, not token ids"):
        llm.score([1, 2, 3], DOCS[0])
    no_leaks(llm)


def test_the_activation_follows_the_config(tmp_path):
    """vLLM's activations: ``problem_type`` multi_label_classification takes a sigmoid per label
    (regression none); a cross-encoder's sentence-transformers ``activation_fn`` Identity scores
    with the raw logit (classify keeps its sigmoid)."""
    multi = make_tiny_classifier("llama", tmp_path / "multi", 3, problem_type="multi_label_classification")
    llm = LLM(str(tmp_path / "multi"), device="cpu", dtype="float32")
    (o,) = llm.classify(QUERY)
    assert close(o.outputs.probs, hf_logits(multi, o.prompt_token_ids).sigmoid())
    ident = {"activation_fn": "torch.nn.modules.linear.Identity"}
    ce = make_tiny_classifier("llama", tmp_path / "ce", 1, sentence_transformers=ident)
    llm = LLM(str(tmp_path / "ce"), device="cpu", dtype="float32")
    (s,) = llm.score(QUERY, DOCS[0])
    assert s.outputs.score == pytest.approx(float(hf_logits(ce, s.prompt_token_ids)[0]), abs=TOL)
    (c,) = llm.classify(QUERY)
    assert close(c.outputs.probs, hf_logits(ce, c.prompt_token_ids).sigmoid())
    reg = make_tiny_classifier("llama", tmp_path / "reg", 1, problem_type="regression")
    (r,) = LLM(str(tmp_path / "reg"), device="cpu", dtype="float32").classify(QUERY)
    assert close(r.outputs.probs, hf_logits(reg, r.prompt_token_ids))


@pytest.mark.gpu
def test_classify_and_cross_encoder_on_cuda(tmp_path_factory):
    """On CUDA (Triton kernels, fp32; a classifier's runner is eager) the probabilities and a
    cross-encoder's scores are transformers' on the same weights, also chunked, and the engine
    keeps serving with every block back."""
    path, hf = classifier(tmp_path_factory, "qwen3", 3)
    llm = LLM(str(path), device="cuda", dtype="float32", max_num_batched_tokens=16, max_model_len=256,
              kv_cache_blocks=64)
    assert llm.engine.runner.graphs is None
    for p, o in zip(PROMPTS, llm.classify(PROMPTS)):
        assert close(o.outputs.probs, hf_logits(hf, llm.tokenize(p)).softmax(-1))
    no_leaks(llm)
    path, hf = classifier(tmp_path_factory, "llama", 1)
    llm = LLM(str(path), device="cuda", dtype="float32", kv_cache_blocks=64)
    tok = llm.tokenizer
    for doc, o in zip(DOCS, llm.score(QUERY, DOCS)):
        want = hf_logits(hf, tok(QUERY, doc).input_ids).sigmoid()
        assert abs(o.outputs.score - float(want[0])) < TOL
    no_leaks(llm)
