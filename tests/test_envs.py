"""The switch registry (blitzllm/envs.py): every BLITZ_* variable the package reads is declared
there, at most 20 of them, docs/switches.md is generated from it, values parse and fail clearly."""
import pathlib
import re

import pytest

from blitzllm import envs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_switch_the_package_names_is_declared_once():
    named = set()
    for path in (ROOT / "blitzllm").rglob("*.py"):
        if path.name != "envs.py":
            named |= set(re.findall(r"BLITZ_[A-Z0-9_]+", path.read_text()))
    undeclared = sorted(named - set(envs.SWITCHES))
    assert not undeclared, f"read but not declared in blitzllm/envs.py: {undeclared}"
    assert len(envs.SWITCHES) <= 20, f"{len(envs.SWITCHES)} switches; the design allows at most 20"
    assert all(s.kind in (envs.SETTING, envs.KNOB) and s.doc for s in envs.SWITCHES.values())


def test_every_declared_switch_is_read_somewhere():
    """A switch no code reads is a stale declaration: knobs are read through ``Knobs`` (a field
    per knob), settings by name."""
    knob_fields = {"BLITZ_" + f.upper() for f in envs.Knobs.__dataclass_fields__}
    text = "\n".join(p.read_text() for p in (ROOT / "blitzllm").rglob("*.py") if p.name != "envs.py")
    for name, sw in envs.SWITCHES.items():
        assert name in text or name in knob_fields, f"{name} is declared but nothing reads it"
    for name in knob_fields:
        assert name in envs.SWITCHES, f"Knobs field for undeclared {name}"


def test_switches_doc_is_generated_and_current():
    doc = ROOT / "docs" / "switches.md"
    assert doc.read_text() == envs.markdown(), "docs/switches.md is stale: python -m blitzllm.envs > docs/switches.md"
    for name in envs.SWITCHES:
        assert f"`{name}`" in doc.read_text()


def test_values_parse_and_bad_values_name_the_variable():
    env = {"BLITZ_PDL": "0", "BLITZ_TP_TIMEOUT": "2.5", "BLITZ_MOE_SPLIT": "expert",
           "BLITZ_GEMV_CONFIG": '{"BLOCK_N": 8}'}
    assert envs.get("BLITZ_PDL", env) is False
    assert envs.get("BLITZ_TP_TIMEOUT", env) == 2.5
    assert envs.get("BLITZ_MOE_SPLIT", env) == "expert"
    assert envs.get("BLITZ_GEMV_CONFIG", env) == {"BLOCK_N": 8}
    assert envs.get("BLITZ_GEMV", env) is True  # unset: the default
    for name, bad in (("BLITZ_PDL", "maybe"), ("BLITZ_TP_TIMEOUT", "soon"), ("BLITZ_MOE_SPLIT", "rows"),
                      ("BLITZ_GEMV_CONFIG", "{nope")):
        with pytest.raises(ValueError, match=name):
            envs.get(name, {name: bad})
    with pytest.raises(KeyError):
        envs.get("BLITZ_NOT_A_SWITCH")


def test_knobs_are_read_when_asked_not_at_import(monkeypatch):
    assert envs.Knobs.from_env({}) == envs.Knobs()
    monkeypatch.setenv("BLITZ_GEMV", "0")
    monkeypatch.setenv("BLITZ_REFERENCE", "1")
    k = envs.Knobs.from_env()
    assert k.gemv is False and k.reference is True
    with pytest.raises(Exception):
        k.gemv = True  # frozen
