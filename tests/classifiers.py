"""Tiny random sequence classifiers (transformers' ``*ForSequenceClassification``), saved with a
word-level tokenizer whose pair encoding differs from concatenation (``<s> A </s> B </s>``), so a
cross-encoder test sees that the engine scores the tokenizer's pair sequence."""
from __future__ import annotations

import torch

from tests.conftest import TINY

WORDS = ("what is the capital of france paris berlin a city in germany bananas are yellow and sweet eiffel tower "
         "stands quick brown fox jumps over lazy dog while cat sleeps on warm mat rivers run down from mountains "
         "to sea carrying stones sand hello my name how many legs does spider have eight spiders insects "
         "? . ,").split()
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def tiny_tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "<pad>", *dict.fromkeys(WORDS)])}
    t = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    t.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", 1), ("</s>", 2)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="<pad>")


def make_tiny_classifier(arch: str, path, num_labels: int = 3, seed: int = 0, **config):
    """transformers' classifier of ``arch`` (llama, qwen2, qwen3), random, float32, saved to
    ``path`` with ``tiny_tokenizer()``; returns the model (the oracle)."""
    import transformers
    torch.manual_seed(seed)
    labels = {i: LABELS.get(i, f"LABEL_{i}") for i in range(num_labels)} if num_labels > 1 else {0: "relevance"}
    kw = dict(TINY, id2label=labels, label2id={v: k for k, v in labels.items()}, pad_token_id=None, **config)
    cfg_cls, model_cls, extra = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification, {}),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification, {}),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForSequenceClassification, {"head_dim": 16}),
    }[arch]
    model = model_cls(cfg_cls(rope_theta=10000.0, **extra, **kw)).float().eval()
    model.save_pretrained(str(path), safe_serialization=True)
    tiny_tokenizer().save_pretrained(str(path))
    return model


def hf_logits(model, ids: list) -> torch.Tensor:
    """The oracle's class logits for ``ids`` alone (its last token pooled)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()
