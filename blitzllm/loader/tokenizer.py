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


def load_tokenizer(spec: str):
    """vLLM's ``tokenizer`` argument: another source of the tokenizer than the model's own, a folder
    with tokenizer files, a .gguf file (its metadata's) or a hub id; a ValueError says why not."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"tokenizer must be a folder, a .gguf file or a hub id, got {spec!r}")
    path = Path(os.path.expanduser(spec))
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf_tokenizer(path)
    if path.is_dir():
        tok = load_hf_tokenizer(path)
        if tok is None:
            raise ValueError(f"tokenizer folder {spec} has no tokenizer.json, tokenizer_config.json or tokenizer.model")
        return tok
    if spec.count("/") != 1 or spec.startswith((".", "/", "~")):   # (not "owner/name")
        raise ValueError(f"tokenizer {spec!r} is not a folder, a .gguf file or a hub id")
    _quiet_transformers()
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(spec)
    except Exception as e:  # noqa: BLE001 - offline, unknown repo: the user's to fix
        raise ValueError(f"tokenizer {spec!r} could not be fetched from the hub ({type(e).__name__})") from None


def set_chat_template(tok, template: str) -> None:
    """``chat_template`` (vLLM's --chat-template): a file's path or the Jinja text itself, over the
    tokenizer's own; tried on a one-message conversation so a broken template fails at start-up,
    not on every request."""
    if tok is None:
        raise ValueError("chat_template: this model has no tokenizer to render it")
    if not isinstance(template, str) or not template:
        raise ValueError(f"chat_template must be a file or a Jinja template, got {template!r}")
    path = Path(os.path.expanduser(template))
    if path.is_file():
        template = path.read_text(encoding="utf-8")
    elif "{{" not in template and "{%" not in template:
        raise ValueError(f"chat_template {template!r} is neither a file nor a Jinja template")
    tok.chat_template = template
    try:
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja2's syntax and undefined errors, the template's own raise
        raise ValueError(f"chat_template does not render a one-message conversation: "
                         f"{type(e).__name__}: {e}") from None


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
