"""Structured outputs through xgrammar: validating ``SamplingParams.structured_output``, a
grammar compiler per engine (compiled grammars cached by spec) and a matcher per sequence
that yields each step's allowed tokens. Knows nothing about the sampler or HTTP
(docs/serving.md#structured-outputs).
"""
from __future__ import annotations

import functools
import json
import warnings
from typing import Optional

import torch

INSTALL = "structured outputs need xgrammar: pip install xgrammar"


KINDS = {"json_object": None, "json_schema": "schema", "regex": "pattern", "choice": "choices", "grammar": "grammar",
         "structural_tag": "structural_tag"}


def check_structured_output(spec) -> Optional[dict]:
    """The normalised spec ({"type": ..., and its one key as a string}) of a
    ``structured_output`` value; ValueError for anything else. An optional ``"start_after"``
    (a non-empty string, such as a thinking model's ``"</think>"``) keeps it: the grammar
    applies only once the output has emitted that text, every token being allowed before
    (vLLM's reasoning-aware structured outputs)."""
    if spec is None:
        return None
    out = _check_kind(spec)
    after = spec.get("start_after")
    if after is not None:
        if not isinstance(after, str) or not after:
            raise ValueError(f"structured_output start_after must be a non-empty string, got {after!r}")
        out["start_after"] = after
    return out


def _check_kind(spec) -> dict:
    if not isinstance(spec, dict) or spec.get("type") not in KINDS:
        raise ValueError("structured_output must be {'type': 'json_object'}, {'type': 'json_schema', 'schema': "
                         "{...}}, {'type': 'regex', 'pattern': ...}, {'type': 'choice', 'choices': [...]}, "
                         "{'type': 'grammar', 'grammar': ...} or {'type': 'structural_tag', 'structural_tag': {...}}, "
                         f"got {spec!r}")
    kind = spec["type"]
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "structural_tag":
        return {"type": kind, "structural_tag": _structural_tag(spec.get("structural_tag"))}
    if kind in ("regex", "grammar"):
        value = spec.get(KINDS[kind])
        if not isinstance(value, str) or not value:
            raise ValueError(f"structured_output {kind} needs a non-empty '{KINDS[kind]}' string")
        return {"type": kind, KINDS[kind]: value}
    if kind == "choice":
        choices = spec.get("choices")
        if isinstance(choices, str):  # the normalised form, a JSON list, met again (SamplingParams.clone)
            try:
                choices = json.loads(choices)
            except ValueError:
                pass
        if (isinstance(choices, str) or not isinstance(choices, (list, tuple)) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise ValueError("structured_output choice needs 'choices': a list of non-empty strings")
        return {"type": "choice", "choices": json.dumps(list(choices))}
    schema = spec.get("schema")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:  # (RecursionError: nested too deeply)
            raise ValueError(f"structured_output schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_output json_schema needs a 'schema' object, got {schema!r}")
    return {"type": "json_schema", "schema": json.dumps(schema)}  # (key order kept: it orders the properties)


def _structural_tag(tag) -> str:
    """A structural tag (xgrammar's; vLLM's ``response_format`` ``structural_tag``) as JSON text:
    free text until one of ``triggers`` begins a tag, then the tag's ``schema`` up to its ``end``
    (the legacy form, ``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}``), or
    xgrammar's ``{"format": {...}}`` form, which xgrammar checks when it compiles it."""
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"structured_output structural_tag is not valid JSON: {e}") from None
    if not isinstance(tag, dict) or ("structures" in tag) == ("format" in tag):
        raise ValueError("structured_output structural_tag must be an object with 'structures' and 'triggers' "
                         f"(the legacy form) or with 'format', got {tag!r}")
    if "format" in tag:
        if not isinstance(tag["format"], dict):
            raise ValueError(f"structured_output structural_tag format must be an object, got {tag['format']!r}")
        return json.dumps({**tag, "type": "structural_tag"})
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structured_output structural_tag needs 'triggers': a list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structured_output structural_tag needs 'structures': a non-empty list")
    for s in structures:
        if (not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not s["begin"]
                or not isinstance(s.get("end"), str) or not isinstance(s.get("schema", {}), (dict, type(None)))):
            raise ValueError("each structural_tag structure needs 'begin' (a non-empty string), 'end' (a string) and "
                             f"'schema' (an object), got {s!r}")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise ValueError(f"structural_tag begin {s['begin']!r} starts with none of the triggers {triggers!r}")
    return json.dumps({"structures": [{"begin": s["begin"], "schema": s.get("schema") or {}, "end": s["end"]}
                                      for s in structures], "triggers": triggers})


class GrammarCompiler:
    """An engine's compiler: matchers for structured-output specs over its tokenizer."""

    def __init__(self, tokenizer, vocab_size: int):
        try:
            import xgrammar as xgr
        except ImportError:
            raise ValueError(INSTALL) from None
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer")
        self.xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info)
        self._compiled = functools.lru_cache(maxsize=64)(self._compile)
        self._vocab = None

    def _compile(self, kind: str, value: Optional[str]):
        c = self.compiler
        try:
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}')
            if kind == "json_schema":
                return c.compile_json_schema(value)
            if kind == "regex":
                return c.compile_regex(value)
            if kind == "choice":
                return c.compile_regex("|".join(_regex_escape(s) for s in json.loads(value)))
            if kind == "structural_tag":
                return self._compile_structural_tag(value)
            return c.compile_grammar(value)
        except Exception as e:  # (xgrammar's own error for a schema, pattern or grammar it cannot take)
            what = {"json_schema": "schema", "regex": "pattern", "grammar": "grammar"}.get(kind, kind)
            raise ValueError(f"structured_output {what} not supported: {e}") from None

    def _compile_structural_tag(self, value: str):
        tag = json.loads(value)
        if "format" in tag:
            return self.compiler.compile_structural_tag(value)
        items = [self.xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        with warnings.catch_warnings():   # (xgrammar keeps the legacy form, which vLLM's API still takes)
            warnings.simplefilter("ignore", DeprecationWarning)
            return self.compiler.compile_structural_tag(items, tag["triggers"])

    def compile(self, spec: dict):
        """The compiled grammar of a spec (``check_structured_output``'s form), cached: ValueError when
        xgrammar cannot take it. Safe from several threads (xgrammar compiles in parallel)."""
        key = KINDS[spec["type"]]
        return self._compiled(spec["type"], spec.get(key) if key else None)

    def matcher(self, spec: dict):
        """A fresh matcher of ``spec``; ValueError when its grammar admits no output at all (an
        empty language such as the regex ``[^\\s\\S]``: every token would be masked)."""
        m = self.xgr.GrammarMatcher(self.compile(spec))
        first = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        m.fill_next_token_bitmask(first, 0)
        if not first.any():
            raise ValueError(f"structured_output {spec['type']} admits no output: its grammar matches nothing")
        if spec.get("start_after"):
            if self._vocab is None:   # (each token's bytes, read once)
                self._vocab = self.info.decoded_vocab
            m = StartAfter(m, spec["start_after"].encode(), self._vocab)
        return m


class StartAfter:
    """A grammar matcher that starts once the output's bytes hold ``marker`` (the token that
    completes it included; the grammar takes the tokens after it): until then every token is
    allowed. What the engine and the sampler call of an xgrammar matcher."""

    def __init__(self, matcher, marker: bytes, vocab: list):
        self.matcher, self.marker, self.vocab = matcher, marker, vocab
        self.tail = b""      # the output's last len(marker) - 1 bytes, while not started
        self.started = False

    def accept_token(self, tok: int) -> bool:
        if self.started:
            return self.matcher.accept_token(tok)
        text = self.tail + (self.vocab[tok] if 0 <= tok < len(self.vocab) else b"")
        self.started = self.marker in text
        self.tail = text[-(len(self.marker) - 1):] if len(self.marker) > 1 else b""
        return True

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        if self.started:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.started and self.matcher.is_terminated()


def _regex_escape(s: str) -> str:
    """``s`` as a literal in a regex (every metacharacter escaped). Not ``re.escape``: it also
    escapes characters such as ``#`` and ``~``, which xgrammar's regex reader warns about."""
    return "".join("\\" + ch if ch in r"\.^$|?*+()[]{}/-" else ch for ch in s)


def allowed_mask(matchers: list, vocab_size: int, device) -> Optional[torch.Tensor]:
    """[B, V] bool of the tokens each row may take next (all for rows without a matcher), or
    None when no row has one."""
    if all(m is None for m in matchers):
        return None
    import xgrammar as xgr
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)  # int32 [B, ceil(V / 32)], all set
    for i, m in enumerate(matchers):
        if m is not None:
            m.fill_next_token_bitmask(bitmask, i)
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().reshape(len(matchers), -1)[:, :vocab_size]
    return allowed.to(device, non_blocking=True)
