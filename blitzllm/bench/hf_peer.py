"""transformers as the peer in ``blitz bench latency --compare hf``: the same config and the
very same weight tensors (shared, not copied), timed eager and (on CUDA) with a static cache
plus torch.compile, the way transformers' own docs recommend for fast decode."""
from __future__ import annotations

import time

import torch

from ..loader.weights import export_hf_state_dict
from .roofline import sync

_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def build_hf_peer(model, cfg):
    import transformers
    hf_cfg = dict(cfg.hf_config)
    mt = hf_cfg.pop("model_type", None) or _MODEL_TYPES[cfg.architecture]
    for k in ("architectures", "transformers_version", "torch_dtype", "dtype"):
        hf_cfg.pop(k, None)
    hf_cfg["num_hidden_layers"] = cfg.num_layers
    conf = transformers.AutoConfig.for_model(mt, **hf_cfg)
    device = next(model.parameters()).device
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(conf, dtype=next(model.parameters()).dtype)
    sd = export_hf_state_dict(model)
    missing, unexpected = hf.load_state_dict(sd, strict=False, assign=True)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"weights do not map onto transformers: missing={missing[:4]} unexpected={unexpected[:4]}")
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    # non-persistent buffers (rotary inv_freq) were left on meta: rebuild those modules for real
    for mod in hf.modules():
        if any(b.is_meta for b in mod.buffers(recurse=False)):
            with torch.device(device):
                fresh = type(mod)(config=mod.config)
            for name, buf in fresh.named_buffers(recurse=False):
                setattr(mod, name, buf)
            if hasattr(fresh, "attention_scaling"):
                mod.attention_scaling = fresh.attention_scaling
    return hf.eval()


def hf_decode_seconds_per_token(hf, prompts: torch.Tensor, output_len: int, compiled: bool,
                                repeats: int = 1) -> float:
    """Decode time per step, (T(output_len) - T(1)) / (output_len - 1), greedy, no EOS stop;
    with ``repeats`` > 1 the median of that many such estimates (the compiled peer's single
    estimates spread by several percent from run to run)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    device = prompts.device
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0,
              attention_mask=torch.ones_like(prompts), disable_compile=not compiled)
    if compiled:
        kw["cache_implementation"] = "static"

    def timed(n):
        sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(prompts, max_new_tokens=n, min_new_tokens=n, **kw)
        sync(device)
        return time.perf_counter() - t

    timed(min(output_len, 8))  # warm-up (and compilation)
    if compiled:
        timed(output_len)
    est = sorted(max(timed(output_len) - timed(1), 1e-9) / (output_len - 1) for _ in range(repeats))
    return est[len(est) // 2]
