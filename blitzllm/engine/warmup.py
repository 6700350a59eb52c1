"""The engine's warm-up on CUDA (``EngineArgs.warmup``), run once the runner is built."""
from __future__ import annotations

import random
import sys
import time

import torch

from ..pooling_params import PoolingParams
from ..sampling_params import SamplingParams


def warm_up(engine) -> float:
    """Throw-away requests through every path a first user request takes, so Triton's JIT never
    lands in a time to first token; they leave no trace (blocks, prefix cache, counters).
    Returns the seconds it took."""
    t0 = time.perf_counter()
    vocab, cap = engine.model_config.vocab_size, engine.max_model_len - 4
    g = random.Random(0)
    lengths = [n for n in (min(1000, cap), 3, min(2100, cap)) if n >= 1]
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=3, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)]
    if engine.model_config.is_classifier:   # (it only pools: its prefills are the paths to compile)
        params = [PoolingParams(task="classify")] * 3
    intake = engine.image_intake   # (text only: no image or video placeholders)
    vision = {intake.tokens.image, intake.tokens.video} if intake is not None else set()
    for i, (n, p) in enumerate(zip(lengths, params)):
        ids = [g.randrange(vocab) for _ in range(n)]
        engine.add_request(f"__warmup-{i}", [t if t not in vision else 0 for t in ids], p)
        if i == 0:  # the first two share a batch; the long prompt runs alone
            continue
        while engine.has_unfinished():
            engine.step()
    if engine.kv.num_free_blocks != engine.kv.num_blocks or engine.states_held():
        raise RuntimeError("warm-up left KV blocks or state slots allocated")
    engine.kv.reset_prefix_cache()
    engine.kv.hit_tokens = engine.kv.queried_tokens = 0
    engine.scheduler.num_preemptions = 0
    engine.counters = dict.fromkeys(engine.counters, 0)
    if engine.spec is not None:
        engine.spec.reset_counters()
    torch.cuda.synchronize(engine.device)
    dt = time.perf_counter() - t0
    print(f"[blitz] warm-up requests (kernel compilation) took {dt:.1f}s", file=sys.stderr)
    return dt
