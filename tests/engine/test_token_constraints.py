"""vLLM's token constraints on real SmolLM2: ``allowed_token_ids``, ``bad_words`` and
``truncate_prompt_tokens``, checked against transformers on the same weights (a greedy decode
with the constraint applied to its logits, written here from the definition), with speculative
decoding and in the sampler's metadata."""
import pytest
import torch

from blitzllm import LLM, SamplingParams
from blitzllm.layers.rejection_sampler import spec_rows
from blitzllm.layers.sampler import SamplingMetadata, SamplingRow

PROMPT = "The capital of France is Paris. The capital of Germany is"
N = 16


def hf_constrained_greedy(model, prompt: list, n: int, allowed=None, bad=()) -> list:
    """transformers' greedy decode where each step's argmax is over ``allowed`` (all: None) less
    the tokens that would complete a bad word (a token sequence) after the output so far."""
    out = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[allowed if allowed is not None else slice(None)] = True
        for w in bad:
            if len(out) >= len(w) - 1 and (len(w) == 1 or out[-(len(w) - 1):] == list(w[:-1])):
                keep[w[-1]] = False
        out.append(int(logits.masked_fill(~keep, float("-inf")).argmax()))
    return out


def spellings(tok, word: str) -> list:
    return [tok.encode(t, add_special_tokens=False) for t in (word, " " + word)]


def contains(seq: list, sub: list) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_allowed_token_ids_match_transformers(smollm2_llm, smollm2_hf):
    llm = smollm2_llm
    ids = llm.tokenize(PROMPT)
    free = llm.generate(ids, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))[0].token_ids
    allowed = sorted(set(free[2:10]))   # the free answer's own words, less its first two
    p = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, allowed_token_ids=allowed)
    got = llm.generate(ids, p)[0].token_ids
    assert got == hf_constrained_greedy(smollm2_hf, ids, N, allowed=allowed)
    assert set(got) <= set(allowed) and got[:2] != free[:2]
    # sampled (seeded) rows keep to the set too
    sampled = llm.generate(ids, p.clone(temperature=1.0, seed=7, n=4))[0]
    assert all(set(o.token_ids) <= set(allowed) for o in sampled.outputs)


@pytest.mark.parametrize("words", [["Berlin"], ["capital of", "Berlin"]])
def test_bad_words_match_transformers(smollm2_llm, smollm2_hf, words):
    llm, tok = smollm2_llm, smollm2_llm.tokenizer
    ids = llm.tokenize(PROMPT)
    free = llm.generate(ids, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))[0]
    bad = [s for w in words for s in spellings(tok, w)]
    assert any(contains(free.token_ids, s) for s in bad), "the free answer must spell a bad word"
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, bad_words=words))[0]
    assert out.token_ids == hf_constrained_greedy(smollm2_hf, ids, N, bad=bad)
    assert not any(contains(out.token_ids, s) for s in bad)
    assert not any(w in out.text for w in words)


def test_constraints_with_ngram_speculation(smollm2_llm):
    """The verify step bans a bad word's last token at each draft position after the drafts
    before it, and keeps to allowed_token_ids at every position: greedy outputs equal the plain
    engine's; sampled ones (rejection sampling: the same distribution, not the same draws) never
    spell a bad word that the unconstrained draws spell."""
    spec = LLM("smollm2", dtype="float32", device="cpu", speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    ids = smollm2_llm.tokenize("one two three four, one two three four, one two three four, one two")
    base = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    free = smollm2_llm.generate(ids, base)[0]
    for p in [base.clone(bad_words=["three four"]), base.clone(allowed_token_ids=sorted(set(free.token_ids[1:])))]:
        assert spec.generate(ids, p)[0].token_ids == smollm2_llm.generate(ids, p)[0].token_ids, p
    assert spec.stats()["spec_accepted_tokens"] > 0   # (drafts were verified, some kept)
    four = spellings(smollm2_llm.tokenizer, "four")
    sampled = base.clone(temperature=0.8, seed=3, n=6)
    assert any(contains(o.token_ids, s) for o in spec.generate(ids, sampled)[0].outputs for s in four)
    outs = spec.generate(ids, sampled.clone(bad_words=["four"]))[0].outputs
    assert not any(contains(o.token_ids, s) for o in outs for s in four)


def test_truncate_prompt_tokens_keeps_the_last_k(smollm2_llm):
    llm = smollm2_llm
    ids = llm.tokenize(PROMPT)
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate(PROMPT, p.clone(truncate_prompt_tokens=5))[0]
    assert out.prompt_token_ids == ids[-5:]
    assert out.token_ids == llm.generate(ids[-5:], p)[0].token_ids != llm.generate(ids, p)[0].token_ids
    # a prompt past the context fits once truncated (-1: to max_model_len, then no room is left)
    small = LLM("smollm2", dtype="float32", device="cpu", max_model_len=32)
    long = ids * 4
    with pytest.raises(ValueError, match="no room to generate"):
        small.generate(long, p)
    assert (small.generate(long, p.clone(truncate_prompt_tokens=20))[0].token_ids
            == small.generate(long[-20:], p)[0].token_ids)
    with pytest.raises(ValueError, match="no room to generate"):
        small.generate(long, p.clone(truncate_prompt_tokens=-1))
    with pytest.raises(ValueError, match="truncate_prompt_tokens .* at most max_model_len=32"):
        small.generate(long, p.clone(truncate_prompt_tokens=33))
    stats = small.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.parametrize("kw, match", [
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids must be"),
    ({"allowed_token_ids": "12"}, "allowed_token_ids must be"),
    ({"bad_words": ["ok", " "]}, "bad_words must be a list of non-blank strings"),
    ({"bad_words": "word"}, "bad_words must be"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be"),
])
def test_bad_values_are_value_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_out_of_vocabulary_allowed_ids_are_refused(smollm2_llm):
    with pytest.raises(ValueError, match=r"allowed_token_ids must be in \[0, 49152\)"):
        smollm2_llm.generate("Hi", SamplingParams(allowed_token_ids=[5, 49152]))
    assert not smollm2_llm.engine.has_unfinished()


def test_metadata_bans_a_bad_words_last_token_after_its_prefix():
    p = SamplingParams(temperature=0, bad_words=["x"])
    words = ((7,), (3, 4, 5))
    rows = [SamplingRow(p, 0, [1], out, None, bad_words=words) for out in ([], [3], [3, 4], [9, 3, 4], [4, 3])]
    md = SamplingMetadata.build(rows, 16, "cpu")
    bans = [sorted(t for t in r if t >= 0) for r in md.banned_tokens.tolist()]
    assert bans == [[7], [7], [5, 7], [5, 7], [7]]
    # speculative rows: each draft position is checked after the drafts before it
    spec = SamplingMetadata.build(spec_rows([rows[1]], [[4, 5]]), 16, "cpu")
    assert [sorted(t for t in r if t >= 0) for r in spec.banned_tokens.tolist()] == [[7], [5, 7], [7]]


@pytest.mark.parametrize("words, match", [
    (["w"] * 129, "at most 128 words"),
    (["x" * 20000], "at most 16384 are taken"),
    ([" ".join(["alpha"] * 600)], "at most 1024 are taken"),
])
def test_bad_words_are_bounded(smollm2_llm, words, match):
    with pytest.raises(ValueError, match=match):
        smollm2_llm.generate("Hi", SamplingParams(bad_words=words))
    assert not smollm2_llm.engine.has_unfinished()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_the_grammar_cannot_take_leave_the_grammar_to_win(smollm2_llm, temperature):
    """allowed_token_ids and a grammar whose next tokens are none of them: the grammar wins (as it
    does over bad words), never a token neither allows (all -inf: token 0, <|endoftext|>)."""
    llm = smollm2_llm
    digits = llm.tokenize("1 2 3")
    regex = {"type": "regex", "pattern": "[0-9]{3}"}
    p = SamplingParams(temperature=temperature, seed=3, max_tokens=8, structured_output=regex,
                       allowed_token_ids=digits)
    out = llm.generate("Number:", p)[0].outputs[0]
    # the digits stay allowed; after three of them the grammar can only end (EOS, not allowed)
    assert len(out.text) == 3 and out.text.isdigit() and out.finish_reason == "stop", (out.text, out.token_ids)
    assert all(t in digits for t in out.token_ids[:3]) and out.token_ids[3:] in ([], list(llm.engine.eos_token_ids[:1]))
    # none of the allowed tokens fits the grammar at all: the grammar's answer
    out = llm.generate("Number:", p.clone(allowed_token_ids=llm.tokenize(" hello")))[0].outputs[0]
    assert len(out.text) == 3 and out.text.isdigit() and out.finish_reason == "stop", (out.text, out.token_ids)
