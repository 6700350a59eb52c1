"""Tokenizers: from an HF folder, or built from GGUF metadata (converted once, then cached
on disk because the conversion takes seconds)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def _quiet_transformers():
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def load_hf_tokenizer(folder: Path):
    _quiet_transformers()
    from transformers import AutoTokenizer
    if not any((folder / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(str(folder))


def _cache_dir() -> Path:
    root = os.environ.get("BLITZ_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "blitzllm")
    return Path(root) / "tokenizers"


def load_gguf_tokenizer(path: Path):
    _quiet_transformers()
    from transformers import AutoTokenizer
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = _cache_dir() / key
    if (cached / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception:
            pass  # a broken cache entry is rebuilt below
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        cached.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(cached))
    except OSError:
        pass  # read-only home: no cache, still works
    return tok
