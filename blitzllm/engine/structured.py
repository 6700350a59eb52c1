"""Structured outputs: ``SamplingParams(structured_output={"type": "json_object"})`` or
``{"type": "json_schema", "schema": {...}}`` (the server's ``response_format``) constrain a
request's tokens to valid JSON (an object; one matching the schema), as vLLM and SGLang do
with xgrammar (``pip install xgrammar``).

Per engine, a grammar compiler over the tokenizer's vocabulary (compiled grammars are cached by
spec); per sequence, a matcher that follows its tokens. Each step the sampler masks the logits
of a constrained row to the tokens its matcher accepts next (``SamplingMetadata.allowed``,
applied with the min_tokens bans, before temperature and top-k/p), and every sampled token
advances the matcher. A constrained row needs its previous token on the host before its next
mask, so the runner's one-step decode look-ahead skips batches holding one, and speculative
decoding drafts nothing for it.
"""
from __future__ import annotations

import functools
import json
from typing import Optional

import torch

INSTALL = "structured outputs need xgrammar: pip install xgrammar"


def check_structured_output(spec) -> Optional[dict]:
    """The normalised spec ({"type": "json_object"} / {"type": "json_schema", "schema": str})
    of a ``structured_output`` value; ValueError for anything else."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") not in ("json_object", "json_schema"):
        raise ValueError("structured_output must be {'type': 'json_object'} or {'type': 'json_schema', "
                         f"'schema': {{...}}}}, got {spec!r}")
    if spec["type"] == "json_object":
        return {"type": "json_object"}
    schema = spec.get("schema")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_output schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_output json_schema needs a 'schema' object, got {schema!r}")
    return {"type": "json_schema", "schema": json.dumps(schema)}  # (key order kept: it orders the properties)


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

    def _compile(self, kind: str, schema: Optional[str]):
        try:
            return self.compiler.compile_json_schema(schema if kind == "json_schema" else '{"type": "object"}')
        except Exception as e:  # (xgrammar's own error for a schema it cannot take)
            raise ValueError(f"structured_output schema not supported: {e}") from None

    def matcher(self, spec: dict):
        return self.xgr.GrammarMatcher(self._compiled(spec["type"], spec.get("schema")))


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
