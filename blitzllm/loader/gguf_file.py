"""GGUF files: HF-style config from the metadata, and a stream of HF-named tensors,
dequantized one at a time (llama.cpp's q/k row permutation undone for Llama).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # ggml type ids of the block formats read here without the gguf package
GRID_TYPES = (Q4_0, Q4_1, Q8_0)
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}

_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def open_gguf(path):
    """(the file's reader, its HF-style config)."""
    try:
        import gguf  # noqa: F401  (its codecs dequantize)
    except ImportError:  # pragma: no cover - gguf is a declared dependency
        raise ValueError("reading .gguf files needs the 'gguf' package: pip install gguf") from None
    from .gguf_reader import GGUFFile
    try:
        reader = GGUFFile(path)
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"cannot read GGUF file {path}: {e}") from None
    return reader, gguf_config(reader)


def gguf_config(reader) -> dict:
    fields = reader.fields
    arch = fields.get("general.architecture")
    if arch not in _ARCH:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(_ARCH))}")
    g = lambda k, d=None: fields.get(f"{arch}.{k}", d)  # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    names = {t.name for t in reader.tensors}
    tokens = fields.get("tokenizer.ggml.tokens", 0)
    vocab = g("vocab_size") or (tokens if isinstance(tokens, int) else len(tokens))
    eos = fields.get("tokenizer.ggml.eos_token_id")
    return {
        "architectures": [_ARCH[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": int(eos) if eos is not None else None,
    }


def _hf_name(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == "blk":
        sub = _LAYER_NAMES.get(parts[2])
        return None if sub is None else f"model.layers.{parts[1]}.{sub}.{parts[3]}"
    top = _TOP_NAMES.get(parts[0])
    return None if top is None else f"{top}.{parts[1]}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of rotary halves in q/k rows."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_heads(name: str, config: dict) -> int | None:
    """The heads of a Llama q / k projection tensor (rows ``_unpermute`` restores), else None."""
    key = {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads"}.get(name.split(".")[-2])
    return config[key] if key and config["architectures"][0] == "LlamaForCausalLM" else None


def raw_blocks(reader, t) -> tuple:
    """(kind, q [N, K], d [N, K/32], m [N, K/32] or None) as numpy arrays from a Q4_0 / Q4_1 /
    Q8_0 tensor's raw bytes (K = ``t.shape[0]``, a multiple of 32)."""
    k = int(t.shape[0])
    n = int(np.prod(t.shape[1:]))
    raw = np.asarray(reader.tensor_data(t)).reshape(n, k // 32, _BLOCK_BYTES[t.tensor_type])
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if t.tensor_type == Q8_0:
        q = raw[..., 2:].copy().view(np.int8).reshape(n, k)
        return "q8", q, d, None
    off = 4 if t.tensor_type == Q4_1 else 2
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if t.tensor_type == Q4_1 else None
    qs = raw[..., off:off + 16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)  # low nibbles first, as ggml
    return "q4", q, d, m


def _dequantize(reader, t) -> np.ndarray:
    """float32 values in GGUF order; the block formats above in one vectorized pass (the gguf
    package's codecs split them row group by row group: seconds per model), with its
    arithmetic, so the values are the same bits (tests/models/test_gguf_dequantize.py)."""
    import gguf
    if t.tensor_type not in GRID_TYPES or int(t.shape[0]) % 32:
        return gguf.quants.dequantize(reader.tensor_data(t), t.tensor_type)
    _, q, d, m = raw_blocks(reader, t)
    n, k = q.shape
    q = q.reshape(n, k // 32, 32)
    if t.tensor_type == Q4_0:
        q = q.astype(np.int8) - np.int8(8)
    out = d[..., None] * q.astype(np.float32)
    if m is not None:
        out += m[..., None]
    return out


def iter_gguf_tensors(reader, config: dict, skip=frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """``skip``: HF names not to read (weights the model already holds in another form)."""
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None or name in skip:
            continue
        shape = tuple(int(s) for s in reversed(t.shape))
        arr = _dequantize(reader, t).reshape(shape)
        heads = _rope_heads(name, config)
        if heads is not None:
            arr = _unpermute(arr, heads)
        if not arr.flags.writeable or arr.dtype != np.float32:
            arr = np.array(arr, dtype=np.float32)
        yield name, torch.from_numpy(np.ascontiguousarray(arr))
