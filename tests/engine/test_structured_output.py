"""Structured outputs (``SamplingParams.structured_output``, blitzllm/structured.py) on the real
SmolLM2: greedy and sampled answers, alone and batched with unconstrained requests, with
n > 1 and beside speculative decoding, parse as JSON of the asked shape; every generated
token was one the grammar allowed (the mask each step, checked against a fresh matcher fed
the same tokens); unconstrained requests in the same batch are unchanged; errors."""
from __future__ import annotations

import json

import pytest

from blitzllm import LLM, SamplingParams
from tests.conftest import needs_xgrammar

# Only the tests that compile a grammar need xgrammar; the spec validation tests run without it.

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
QUESTION = [{"role": "user", "content": "Describe a person as JSON with name, age and city."}]


def _check_person(text: str) -> dict:
    obj = json.loads(text)
    assert list(obj) == ["name", "age", "city"]  # the schema's properties, in its order
    assert isinstance(obj["name"], str) and isinstance(obj["age"], int) and not isinstance(obj["age"], bool)
    assert isinstance(obj["city"], str)
    return obj


def _all_allowed(llm, spec, token_ids) -> bool:
    """Whether each token was in the grammar's allowed set at its step (a fresh matcher)."""
    import xgrammar as xgr
    m = llm.engine.grammars.matcher(spec)
    V = llm.engine.model_config.vocab_size
    for t in token_ids:
        bm = xgr.allocate_token_bitmask(1, V)
        m.fill_next_token_bitmask(bm, 0)
        if not (int(bm[0, t // 32]) >> (t % 32)) & 1:
            return False
        m.accept_token(t)
    return True


@needs_xgrammar
def test_json_schema_and_object(smollm2_llm):
    llm = smollm2_llm
    prompt = llm.apply_chat_template(QUESTION)
    plain = SamplingParams(temperature=0, max_tokens=80)
    schema = SamplingParams(temperature=0, max_tokens=80, structured_output={"type": "json_schema", "schema": PERSON})
    obj = SamplingParams(temperature=0, max_tokens=80, structured_output={"type": "json_object"})
    alone = llm.generate([prompt], plain)[0]
    outs = llm.generate([prompt, prompt, prompt], [schema, obj, plain])   # one batch, mixed
    assert outs[2].token_ids == alone.token_ids   # the unconstrained row is untouched
    for out, p in zip(outs[:2], (schema, obj)):
        assert out.finish_reason == "stop"
        assert _all_allowed(llm, p.structured_output, out.token_ids[:-1])  # (the last: EOS once complete)
    _check_person(outs[0].text)
    assert isinstance(json.loads(outs[1].text), dict)
    assert not alone.text.lstrip().startswith("{")  # (the model alone wraps JSON in prose here)


@needs_xgrammar
def test_sampled_and_n(smollm2_llm):
    llm = smollm2_llm
    prompt = llm.apply_chat_template(QUESTION)
    p = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=100, n=3, seed=3,
                       structured_output={"type": "json_schema", "schema": PERSON})
    outs = llm.generate([prompt], p)[0].outputs
    assert len(outs) == 3
    for o in outs:
        if o.finish_reason == "stop":
            _check_person(o.text)
        assert _all_allowed(llm, p.structured_output, o.token_ids[:len(o.token_ids) - (o.finish_reason == "stop")])
    assert any(o.finish_reason == "stop" for o in outs)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


@needs_xgrammar
def test_beside_speculative_decoding():
    llm = LLM("smollm2", dtype="float32", device="cpu", kv_cache_blocks=128,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompt = llm.apply_chat_template(QUESTION)
    p = SamplingParams(temperature=0, max_tokens=80, structured_output={"type": "json_schema", "schema": PERSON})
    plain = SamplingParams(temperature=0, max_tokens=40)
    outs = llm.generate([prompt, prompt], [p, plain])
    _check_person(outs[0].text)
    ref_llm = LLM("smollm2", dtype="float32", device="cpu", kv_cache_blocks=128)
    ref = ref_llm.generate([prompt], plain)[0]
    assert outs[1].token_ids == ref.token_ids
    # constrained rows batched with rows that do draft (a repeating prompt): every verify step
    # masks the constrained rows too (before: their matchers were dropped from the verify rows and
    # the greedy fast path took the raw argmax, so they left their grammar), and all outputs
    # equal the engine without speculation
    repeat = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"
    specs = [{"type": "regex", "pattern": "[a-z ,]+"}, {"type": "choice", "choices": ["alpha", "beta"]},
             {"type": "json_schema", "schema": PERSON}]
    for temperature in (0.0, 0.7):
        ps = [SamplingParams(temperature=temperature, seed=5, max_tokens=24, structured_output=sp) for sp in specs]
        ps.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        before = llm.stats()["spec_accepted_tokens"]
        got = llm.generate(["x = [1, 1, 1, 1, 1,", "Pick one:", prompt, repeat], ps)
        assert llm.stats()["spec_accepted_tokens"] > before   # (the repeating row drafted)
        want = ref_llm.generate(["x = [1, 1, 1, 1, 1,", "Pick one:", prompt, repeat], ps)
        for g, w, q in zip(got, want, ps):
            assert g.token_ids == w.token_ids, (temperature, q.structured_output, g.text, w.text)
            if q.structured_output is not None:
                assert _all_allowed(llm, q.structured_output, g.token_ids[:-1] if g.finish_reason == "stop"
                                    else g.token_ids)


@pytest.mark.parametrize("spec,match", [
    ({"type": "xml"}, "structured_output must be"),
    ({"type": "json_schema"}, "needs a 'schema' object"),
    ({"type": "json_schema", "schema": "{not json"}, "not valid JSON"),
    ("json", "structured_output must be"),
])
def test_spec_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_output=spec)


@needs_xgrammar
def test_unsupported_schema_is_a_value_error(smollm2_llm):
    with pytest.raises(ValueError, match="structured_output schema not supported"):
        smollm2_llm.generate(["hi"], SamplingParams(structured_output={"type": "json_schema",
                                                                        "schema": {"type": "nonsense"}}))
    assert smollm2_llm.stats()["kv_blocks_free"] == smollm2_llm.stats()["kv_blocks_total"]


@needs_xgrammar
def test_regex_choice_grammar(smollm2_llm):
    """The other kinds: a regex, a choice among strings, an EBNF grammar."""
    import re
    llm = smollm2_llm
    prompt = llm.apply_chat_template([{"role": "user", "content": "Is the sky blue? Answer yes or no."}])
    params = dict(temperature=0, max_tokens=24)
    date = llm.generate([prompt], SamplingParams(**params, structured_output={
        "type": "regex", "pattern": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}))[0]
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.text) and date.finish_reason == "stop"
    choices = ["yes", "no", "it depends (a.k.a. maybe)"]
    pick = llm.generate([prompt], SamplingParams(**params, structured_output={"type": "choice", "choices": choices}))[0]
    assert pick.text in choices and pick.finish_reason == "stop"
    g = 'root ::= "The answer is " ("A" | "B") "."'
    ans = llm.generate([prompt], SamplingParams(**params, structured_output={"type": "grammar", "grammar": g}))[0]
    assert ans.text in ("The answer is A.", "The answer is B.")


@pytest.mark.parametrize("spec,match", [
    ({"type": "regex", "pattern": ""}, "needs a non-empty 'pattern'"),
    ({"type": "choice", "choices": "yes"}, "list of non-empty strings"),
    ({"type": "choice", "choices": []}, "list of non-empty strings"),
    ({"type": "grammar"}, "needs a non-empty 'grammar'"),
])
def test_more_spec_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_output=spec)


@pytest.mark.parametrize("spec", [
    {"type": "choice", "choices": ["yes", "no, never", "[1]"]}, {"type": "regex", "pattern": "a+"},
    {"type": "json_schema", "schema": {"type": "object"}}, {"type": "json_object"},
    {"type": "grammar", "grammar": 'root ::= "x"'}, {"type": "choice", "choices": ["a"], "start_after": "</think>"},
    {"type": "structural_tag", "structural_tag": {"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}],
                                                  "triggers": ["<f"]}},
    {"type": "structural_tag", "structural_tag": {"format": {"type": "const_string", "value": "x"}}},
])
def test_normalised_spec_validates_again(spec):
    """SamplingParams.clone validates the normalised spec again: it must pass and stay the same
    (before: a choice's normalised JSON list was "not a list", so clone() raised)."""
    p = SamplingParams(structured_output=spec)
    assert p.clone(max_tokens=3).structured_output == p.structured_output


@needs_xgrammar
def test_a_grammar_ends_the_output_over_ignore_eos_and_min_tokens(smollm2_llm):
    """Once the grammar has taken its stop token no token may follow: the output ends there
    ("stop") even with ignore_eos (before: the next step's mask raised in xgrammar, a 500) or a
    min_tokens past it (before: EOS banned left no token allowed, and token 0 came out as
    often as min_tokens asked); greedy and sampled; the KV blocks all come back."""
    llm = smollm2_llm
    spec = {"type": "choice", "choices": ["yes", "no"]}
    prompt = llm.apply_chat_template([{"role": "user", "content": "Is the sky blue? Answer yes or no."}])
    for extra in ({"ignore_eos": True}, {"min_tokens": 6}, {"ignore_eos": True, "min_tokens": 6}):
        for temperature in (0.0, 1.0):
            p = SamplingParams(temperature=temperature, max_tokens=8, seed=1, structured_output=spec, **extra)
            out = llm.generate([prompt], p)[0]
            assert out.text in spec["choices"] and out.finish_reason == "stop", (extra, out)
            assert _all_allowed(llm, p.structured_output, out.token_ids[:-1])
            assert out.token_ids[-1] in llm.engine.eos_token_ids   # the grammar's stop token, last
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


@needs_xgrammar
def test_a_grammar_that_matches_nothing_is_a_value_error(smollm2_llm):
    """A regex of an empty language compiles, but every token would be masked (before: token 0
    until max_tokens): refused when the request is added, nothing held."""
    with pytest.raises(ValueError, match="admits no output"):
        smollm2_llm.generate(["hi"], SamplingParams(max_tokens=4, structured_output={
            "type": "regex", "pattern": r"[^\s\S]"}))
    assert smollm2_llm.stats()["kv_blocks_free"] == smollm2_llm.stats()["kv_blocks_total"]


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
WEATHER = [{"role": "system", "content": "To call a function, write get_weather{json args}."},
           {"role": "user", "content": "What's the weather in Paris? Call get_weather."}]


@needs_xgrammar
@pytest.mark.parametrize("form", ["legacy", "format"])
def test_structural_tag(smollm2_llm, form):
    """vLLM's structural_tag (xgrammar's): free text until a trigger, then the tag's begin, JSON of
    its schema and its end, then free text again. SmolLM2's greedy answer here opens "To call
    get_weather, you can": under a tag triggered by " get" the free "To call" stays, " get" must go on
    as " get_weather", then a {"city": ...} object and ".", in both the legacy form and xgrammar's
    "format" form; every token was one the grammar allowed."""
    llm = smollm2_llm
    if form == "legacy":
        tag = {"structures": [{"begin": " get_weather", "schema": CITY, "end": "."}], "triggers": [" get"]}
    else:
        tag = {"format": {"type": "triggered_tags", "triggers": [" get"], "tags": [
            {"begin": " get_weather", "content": {"type": "json_schema", "json_schema": CITY}, "end": "."}]}}
    p = SamplingParams(temperature=0, max_tokens=40, structured_output={"type": "structural_tag", "structural_tag": tag})
    plain = llm.chat(WEATHER, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    assert plain.startswith("To call get_weather,")   # (prose, not the tag's JSON)
    out = llm.chat(WEATHER, p)[0].outputs[0]
    assert out.text.startswith("To call get_weather{"), out.text
    obj, end = json.JSONDecoder().raw_decode(out.text, len("To call get_weather"))
    assert list(obj) == ["city"] and isinstance(obj["city"], str) and out.text[end] == "."
    assert _all_allowed(llm, p.structured_output, out.token_ids)
    as_text = SamplingParams(structured_output={"type": "structural_tag", "structural_tag": json.dumps(tag)})
    assert as_text.structured_output == p.structured_output    # (a JSON string is the same tag)


@pytest.mark.parametrize("tag,match", [
    ({"triggers": ["<f"]}, "with 'structures' and 'triggers'"),
    ({"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<f"], "format": {}}, "or with 'format'"),
    ({"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": []}, "'triggers': a list"),
    ({"structures": [], "triggers": ["<f"]}, "'structures': a non-empty list"),
    ({"structures": [{"begin": "<f>", "end": 3}], "triggers": ["<f"]}, "each structural_tag structure needs"),
    ({"structures": [{"begin": "<g>", "schema": {}, "end": "</g>"}], "triggers": ["<f"]}, "starts with none of"),
    ({"format": "x"}, "format must be an object"),
    ("{not json", "not valid JSON"),
])
def test_structural_tag_errors(tag, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_output={"type": "structural_tag", "structural_tag": tag})


@needs_xgrammar
def test_structural_tag_xgrammar_refuses_is_a_value_error(smollm2_llm):
    """A "format" that xgrammar cannot take is a ValueError when the request is added; nothing held."""
    with pytest.raises(ValueError, match="structured_output structural_tag not supported"):
        smollm2_llm.generate(["hi"], SamplingParams(structured_output={
            "type": "structural_tag", "structural_tag": {"format": {"type": "no_such_format"}}}))
    assert smollm2_llm.stats()["kv_blocks_free"] == smollm2_llm.stats()["kv_blocks_total"]
