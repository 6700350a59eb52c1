"""``speculative_config``: parsed from a dict or a JSON string, validated with errors that
name the field and the allowed values."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Optional, Union

METHODS = ("ngram", "draft_model", "eagle3", "mtp")
MAX_K = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: Optional[str] = None
    synthetic_acceptance_rate: Optional[float] = None

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @property
    def synthetic(self) -> bool:
        return self.synthetic_acceptance_rate is not None


KEYS = tuple(f.name for f in fields(SpeculativeConfig))


def _int(d: dict, key: str, lo: int, hi: int, default=None) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"speculative_config.{key} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def parse_speculative_config(spec: Union[None, str, dict, SpeculativeConfig]) -> Optional[SpeculativeConfig]:
    """None / "" -> None (no speculation); otherwise a validated ``SpeculativeConfig``."""
    if spec is None or isinstance(spec, SpeculativeConfig):
        return spec
    if isinstance(spec, str):
        if not spec.strip():
            return None
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e.msg} at character {e.pos}") from None
    if not isinstance(spec, dict):
        raise ValueError("speculative_config must be a dict or a JSON object string, "
                         f"got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(KEYS))
    if unknown:
        raise ValueError(f"speculative_config has unknown key(s) {', '.join(unknown)}; "
                         f"allowed: {', '.join(KEYS)}")
    method = spec.get("method")
    if method not in METHODS:
        raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}; got {method!r}")
    if "num_speculative_tokens" not in spec:
        raise ValueError("speculative_config.num_speculative_tokens is required (an integer in "
                         f"[1, {MAX_K}])")
    k = _int(spec, "num_speculative_tokens", 1, MAX_K)
    lmax = _int(spec, "prompt_lookup_max", 1, 64, 4)
    lmin = _int(spec, "prompt_lookup_min", 1, 64, 1)
    if lmin > lmax:
        raise ValueError(f"speculative_config.prompt_lookup_min ({lmin}) must be <= prompt_lookup_max ({lmax})")
    model = spec.get("model")
    if method in ("draft_model", "eagle3"):
        if not isinstance(model, str) or not model:
            what = "the draft model's path or name" if method == "draft_model" else \
                "the EAGLE-3 head folder written by `blitz train-draft`"
            raise ValueError(f"speculative_config.model ({what}) is required for method {method!r}")
    elif model is not None:
        raise ValueError(f"speculative_config.model is only used by methods 'draft_model' and 'eagle3', "
                         f"not {method!r}")
    rate = spec.get("synthetic_acceptance_rate")
    if rate is not None:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"speculative_config.synthetic_acceptance_rate must be a number in [0, 1], got {rate!r}")
        rate = float(rate)
    return SpeculativeConfig(method, k, lmax, lmin, model, rate)
