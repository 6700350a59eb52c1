"""A structured output's ``start_after`` (blitzllm/structured.py ``StartAfter``): the grammar
applies only once the output's text holds the marker (a thinking model's ``</think>``), whatever
tokens spell it; every token is allowed before."""
from __future__ import annotations

import pytest
import torch

from blitzllm import SamplingParams
from blitzllm.structured import allowed_mask, check_structured_output
from tests.conftest import needs_xgrammar


@pytest.fixture(scope="module")
def compiler():
    from blitzllm.loader.source import smollm2_path
    from blitzllm.loader.tokenizer import load_gguf_tokenizer
    from blitzllm.structured import GrammarCompiler
    tok = load_gguf_tokenizer(smollm2_path())
    return tok, GrammarCompiler(tok, len(tok))


def test_start_after_is_validated():
    spec = {"type": "choice", "choices": ["yes", "no"], "start_after": "</think>"}
    assert check_structured_output(spec)["start_after"] == "</think>"
    assert SamplingParams(structured_output=spec).structured_output["start_after"] == "</think>"
    for bad in ("", 7, ["</think>"]):
        with pytest.raises(ValueError, match="start_after"):
            check_structured_output({**spec, "start_after": bad})


@needs_xgrammar
@pytest.mark.parametrize("thinking", ["Let me see.</think>", "ok </think>", "a</think>"])
def test_grammar_starts_after_the_marker(compiler, thinking):
    tok, comp = compiler
    ids = tok.encode(thinking, add_special_tokens=False)
    assert len(ids) > 1 and "</think>" not in [tok.decode([i]) for i in ids]   # (spelt by several tokens)
    V = comp.vocab_size
    m = comp.matcher(check_structured_output({"type": "choice", "choices": ["yes", "no"], "start_after": "</think>"}))
    plain = comp.matcher(check_structured_output({"type": "choice", "choices": ["yes", "no"]}))
    first = allowed_mask([plain], V, "cpu")[0]
    assert not all(first[i] for i in ids)   # (the grammar would forbid the thinking)
    for i in ids:   # free while thinking
        assert allowed_mask([m], V, "cpu").all() and not m.is_terminated()
        assert m.accept_token(i)
    # from the marker on, the same as the grammar alone
    assert torch.equal(allowed_mask([m], V, "cpu")[0], first) and first.sum() < V
    for i in tok.encode("yes", add_special_tokens=False):
        assert m.accept_token(i) and plain.accept_token(i)
        assert torch.equal(allowed_mask([m], V, "cpu"), allowed_mask([plain], V, "cpu"))
