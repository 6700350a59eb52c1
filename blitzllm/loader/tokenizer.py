"""Tokenizers: from an HF folder, or built from GGUF metadata (converted once, then cached
on disk because the conversion takes seconds)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .. import envs

def _quiet_transformers():
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def load_hf_tokenizer(folder: Path):
    _quiet_transformers()
    from transformers import AutoTokenizer
    if not any((folder / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(str(folder))


def load_gguf_tokenizer(path: Path):
    _quiet_transformers()
    from transformers import AutoTokenizer
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = envs.get("BLITZ_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "blitzllm")
    cached = Path(root) / "tokenizers" / key
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


_DUMMY_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>: {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}<assistant>: {% endif %}")


def dummy_tokenizer(vocab_size: int, eos_token_id: int | None):
    """A character-level tokenizer for dummy-weight presets, so text prompts, chat and the server
    work on them: printable ASCII is ids 1..95, other ids decode to ``<id>``, eos to nothing."""
    _quiet_transformers()
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    eos = eos_token_id if eos_token_id is not None and 97 <= eos_token_id < vocab_size else vocab_size - 1  # 96 is "\n"
    vocab = {"<unk>": 0}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    vocab["\n"] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab["<|eos|>" if i == eos else f"<{i}>"] = i
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|eos|>", unk_token="<unk>")
    tok.chat_template = _DUMMY_TEMPLATE
    return tok
