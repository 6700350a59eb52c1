"""Every environment variable blitzllm reads, declared once: name, type, default, a line of doc,
and whether it is an operational setting or a kernel A/B knob. Nothing is read at import;
the knobs are read once per engine into ``Knobs``. docs/switches.md is generated from the
table (``python -m blitzllm.envs > docs/switches.md``); docs/design.md#switches.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

SETTING, KNOB = "setting", "knob"


@dataclass(frozen=True)
class Switch:
    name: str
    kind: str          # SETTING (how to run) or KNOB (which kernel form; for A/B runs)
    type: str          # bool | int | float | str | json | choice
    default: Any
    doc: str
    choices: tuple = ()


_SWITCHES = (
    # operational settings
    Switch("BLITZ_API_KEY", SETTING, "str", None,
           "bearer key `blitz serve` and `blitz bench serve` use when `--api-key` is not given"),
    Switch("BLITZ_CACHE", SETTING, "str", None,
           "cache folder for converted tokenizers (default `~/.cache/blitzllm`)"),
    Switch("BLITZ_NO_PROGRESS", SETTING, "bool", False,
           "no weight-loading progress bar (tensor-parallel workers set it: rank 0 shows one)"),
    Switch("BLITZ_CPU_COMPILE", SETTING, "bool", False,
           "CPU decode steps through torch.compile (runner/cpu_graph.py; docs/cpu.md)"),
    Switch("BLITZ_CPU_QGEMM", SETTING, "bool", True,
           "GGUF Q4/Q8 linears on the CPU through our AVX-512 fp32 kernels (0: torch's int4 kernel, bf16 "
           "inputs; kernels/cpu_quant/native.py)"),
    Switch("BLITZ_TP_TIMEOUT", SETTING, "float", 600.0,
           "seconds a tensor-parallel step collective may take before it fails"),
    Switch("BLITZ_TP_STARTUP_TIMEOUT", SETTING, "float", 600.0,
           "seconds tensor-parallel workers may take to start and load"),
    Switch("BLITZ_TP_BARRIER_TIMEOUT", SETTING, "float", 60.0,
           "seconds the one-shot all-reduce waits for its peers before it fails"),
    Switch("BLITZ_TP_ONESHOT_BYTES", SETTING, "int", 512 << 10,
           "largest all-reduce (bytes) that takes the one-shot peer-memory kernel; 0: NCCL always"),
    Switch("BLITZ_MOE_SPLIT", SETTING, "choice", "auto",
           "tensor-parallel MoE split: by expert or by intermediate dim (auto: by expert where the experts "
           "divide over the ranks and an intermediate slice would be thin or uneven)",
           ("auto", "expert", "tensor")),
    Switch("BLITZ_PDL", SETTING, "bool", True,
           "programmatic dependent launch on Hopper (a kernel starts its independent loads while the one "
           "before ends)"),
    # kernel knobs: read once per engine into ``Knobs``, except the tile overrides (JSON), which
    # the launchers' config heuristics read when they first meet a shape
    Switch("BLITZ_REFERENCE", KNOB, "bool", False,
           "every op on its torch reference, on any device (no Triton, no CUDA graphs): the independent "
           "oracle of the GPU end-to-end tests"),
    Switch("BLITZ_GEMV", KNOB, "bool", True,
           "decode GEMMs of up to 16 rows on the Triton GEMV (0: cuBLAS)"),
    Switch("BLITZ_GEMV_TMA", KNOB, "choice", "1",
           "which decode projections take the Hopper TMA GEMV: o_proj and qkv (1), o_proj only, those and "
           "the lm_head (lm_head), o_proj and qkv without their early launch (nodeps), none (0)",
           ("1", "o_proj", "lm_head", "nodeps", "0")),
    Switch("BLITZ_GEMV_CONFIG", KNOB, "json", None,
           "tile override of every GEMV call, e.g. `{\"BLOCK_N\": 8, \"num_warps\": 4}`"),
    Switch("BLITZ_MOE_DECODE_CONFIG", KNOB, "json", None,
           "tile override of the decode MoE launches, e.g. `{\"up\": {\"BLOCK_N\": 32}, \"down\": {...}}`"),
    Switch("BLITZ_GREEDY_KERNEL", KNOB, "bool", True,
           "all-greedy steps pick their tokens in one launch: Triton on CUDA, C on an AVX-512 CPU "
           "(0: torch argmax + log-softmax)"),
)
SWITCHES: Mapping[str, Switch] = {s.name: s for s in _SWITCHES}


def _parse(sw: Switch, raw: str) -> Any:
    try:
        if sw.type == "bool":
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off", ""):
                return False
            raise ValueError
        if sw.type == "int":
            return int(raw)
        if sw.type == "float":
            return float(raw)
        if sw.type == "json":
            return json.loads(raw) if raw.strip() else None
        if sw.type == "choice" and raw not in sw.choices:
            raise ValueError
        return raw
    except ValueError:
        want = {"bool": "0 or 1", "int": "an integer", "float": "a number", "json": "JSON",
                "choice": " | ".join(sw.choices)}.get(sw.type, "a string")
        raise ValueError(f"{sw.name} must be {want}, got {raw!r}") from None


_PARSED: dict = {}  # (name, raw string) -> value: launchers read their settings per call


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The value of switch ``name`` (its default when unset); a ValueError names a bad value."""
    sw = SWITCHES[name]  # (a KeyError for an undeclared name: declare it above first)
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None:
        return sw.default
    key = (name, raw)
    if key not in _PARSED:
        _PARSED[key] = _parse(sw, raw)
    value = _PARSED[key]
    return dict(value) if isinstance(value, dict) else value


@dataclass(frozen=True)
class Knobs:
    """The kernel knobs of one engine, read once when it builds its model
    (``runner/decode_plan.py`` hands them to the layers)."""
    reference: bool = False
    gemv: bool = True
    gemv_tma: str = "1"
    greedy_kernel: bool = True

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Knobs":
        return cls(**{f.name: get("BLITZ_" + f.name.upper(), environ) for f in fields(cls)})


def markdown() -> str:
    """docs/switches.md."""
    lines = ["# Environment switches", "",
             "Generated from `blitzllm/envs.py` (`python -m blitzllm.envs > docs/switches.md`); do not edit.",
             "Settings say how to run; knobs pick a kernel form for A/B runs (the defaults are what measured",
             "fastest; `docs/perf-history.md` keeps the figures of the forms that lost).", ""]
    for kind, title in ((SETTING, "Settings"), (KNOB, "Kernel knobs")):
        lines += [f"## {title}", "", "| variable | type | default | what it does |", "| --- | --- | --- | --- |"]
        for sw in _SWITCHES:
            if sw.kind == kind:
                typ = " \\| ".join(sw.choices) if sw.choices else sw.type
                default = "unset" if sw.default is None else str(int(sw.default) if sw.type == "bool"
                                                                   else sw.default)
                lines.append(f"| `{sw.name}` | {typ} | {default} | {sw.doc} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
