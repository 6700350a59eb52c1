"""Hardware limits for the benchmarks: measured copy bandwidth, bytes one decode step must
move (weights + KV cache + recurrent states), and the profiler's kernel-launch count."""
from __future__ import annotations

import math
import time
from typing import Optional

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Bytes moved per second (read + write) by a large device-to-device copy."""
    n = nbytes // 4
    if device.type == "cpu":
        n = min(n, (256 << 20) // 4)
        iters = 5
    a = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        b.copy_(a)
    sync(device)
    dt = (time.perf_counter() - t) / iters
    return 2 * a.numel() * 4 / dt


def expected_active_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a step of ``batch`` tokens touches when each token picks top_k of
    num_experts uniformly (what balanced routing approaches): E * (1 - (1 - K/E)^B)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def _not_decoded(name: str) -> bool:
    """An MTP head's or the vision tower's parameter: decode steps read neither."""
    return name.startswith(("mtp.", "visual.")) or ".mtp." in name


def weight_bytes_per_step(model: torch.nn.Module, batch: int) -> int:
    """Bytes of weights one decode step reads: every parameter once, except the embedding
    table, of which only the looked-up rows are read (unless it is tied to the lm_head,
    which reads all of it); MoE expert stacks (modules with ``w13``/``w2`` and
    ``num_experts``/``top_k``) count only the experts expected active for ``batch`` tokens
    (``expected_active_experts``; their FP8 scales likewise); MTP heads (``mtp.``) and a vision
    tower (``visual.``), which decoding does not run, count nothing."""
    seen, total = set(), 0
    embed = getattr(getattr(model, "model", model), "embed_tokens", None)
    lm_head = getattr(model, "lm_head", None)
    tied = embed is not None and lm_head is not None and lm_head.weight is embed.weight
    expert_share = {}
    for mod in model.modules():
        if all(hasattr(mod, a) for a in ("w13", "w2", "num_experts", "top_k")):
            frac = expected_active_experts(mod.num_experts, mod.top_k, batch) / mod.num_experts
            for t in (mod.w13, mod.w2, getattr(mod, "w13_scale_inv", None), getattr(mod, "w2_scale_inv", None)):
                if t is not None:
                    expert_share[id(t)] = frac
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if _not_decoded(name):
            continue
        if embed is not None and p is embed.weight and not tied:
            total += batch * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size() * expert_share.get(id(p), 1.0)
    for mod in model.modules():  # a GGUF's grid kept on the CPU (loader/gguf_grid.py)
        if getattr(mod, "quant", None) is not None:
            total += mod.quant.nbytes()
    for name, b in model.named_buffers():  # weight-only int4 layers keep packed buffers, FP8 ones scales
        if name.endswith(("qweight", "qscales_zeros", "scale_inv")) and not _not_decoded(name):
            total += b.numel() * b.element_size() * expert_share.get(id(b), 1.0)
    return int(total)


def kv_bytes_per_step(cfg, context_lens: list, dtype_bytes: int, tp_size: int = 1,
                      cache_bytes: Optional[int] = None) -> int:
    """KV bytes one rank (of ``tp_size``) reads in a decode step, K/V entries of ``cache_bytes``
    each (the KV cache dtype's; default ``dtype_bytes``); a sparse-attention model (DeepSeek-V3.2)
    reads every indexer key but only the ``index_topk`` selected latents."""
    if not cfg.index_topk:
        return sum(context_lens) * cfg.kv_bytes_per_token(dtype_bytes, tp_size, cache_bytes)
    n, h, d = cfg.kv_cache_entry_for(tp_size)
    cache_bytes = dtype_bytes if cache_bytes is None else cache_bytes
    per_layer = sum(c * cfg.index_head_dim * dtype_bytes + min(c, cfg.index_topk) * n * h * d * cache_bytes
                    for c in context_lens)
    return per_layer * len(cfg.kv_layers)


def state_bytes_per_step(cfg, batch: int, dtype_bytes: int, tp_size: int = 1) -> int:
    """Recurrent-state bytes one rank reads and writes in a decode step of ``batch`` sequences:
    each GDN layer reads a sequence's conv and fp32 recurrent state and writes them back (0 for
    models without state layers)."""
    from ..engine.state_cache import state_bytes_per_row
    return 2 * batch * state_bytes_per_row(cfg, dtype_bytes, tp_size)


def count_kernels(fn, device: torch.device, steps: int = 1):
    """Device kernels one call of ``fn`` launches (CUDA only), from ``steps`` profiled calls:
    (count, {name: count}, {name: summed kernel microseconds}, timeline), counts and times
    per call; ``timeline`` = {"span_us": first kernel start to last kernel end,
    "idle_us": the part of the span in which neither a kernel nor a copy runs (the GPU
    waiting for the host or a launch), "overlap_us": summed kernel time beyond the span's
    busy part (kernels that overlap, e.g. with programmatic dependent launch), "copy_us":
    memcpy / memset time, "exposed_us": {name: the step time the kernel adds, see
    ``kernel_exposed``}, "sequence": the kernels of the first profiled step, in stream order,
    as (name, start_us, end_us) relative to its first kernel}, all per call."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize(device)
    names: dict = {}
    micros: dict = {}
    spans, copies, named = [], [], []
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (evt.time_range.start, evt.time_range.end)
        if "memcpy" in evt.name.lower() or "memset" in evt.name.lower():
            copies.append(span)
            continue
        key = evt.name[:80]
        names[key] = names.get(key, 0) + 1
        micros[key] = micros.get(key, 0.0) + evt.time_range.elapsed_us()
        spans.append(span)
        named.append((key, *span))
    n = sum(names.values())
    per = lambda d: {k: v / steps for k, v in d.items()}
    ranked = lambda d: dict(sorted(per(d).items(), key=lambda kv: -kv[1]))  # per call, largest first
    timeline = per(kernel_timeline(spans, copies))
    timeline["exposed_us"] = ranked(kernel_exposed(named))
    named.sort(key=lambda x: x[2])
    first = named[: len(named) // steps] if named else []
    t0 = first[0][1] if first else 0.0
    timeline["sequence"] = [(k, s - t0, e - t0) for k, s, e in first]
    return n / steps, ranked(names), ranked(micros), timeline


def kernel_exposed(named) -> dict:
    """{name: microseconds} from kernels [(name, start_us, end_us), ...]: with the kernels taken
    in order of their end, each is charged end - max(start, the previous kernel's end), the
    stretch of the step that ends with it and that no earlier kernel covers. With programmatic
    dependent launch a kernel starts early and waits; this charges it only for what it adds
    after the one before it ends (its critical-path share), where the plain durations count
    the waits too. Launch gaps (a kernel starting after the previous end) are not charged."""
    out: dict = {}
    prev = -math.inf
    for name, s, e in sorted(named, key=lambda x: x[2]):
        out[name] = out.get(name, 0.0) + (e - max(s, prev))
        prev = e
    return out


def _union(spans) -> float:
    """Length of the union of intervals: taken by start, each adds its part past the ends so far."""
    total, end = 0.0, -math.inf
    for s, e in sorted(spans):
        total += max(0.0, e - max(s, end))
        end = max(end, e)
    return total


def kernel_timeline(spans, copies=()) -> dict:
    """span / idle / overlap / copy microseconds of kernel intervals [(start_us, end_us), ...]
    and copy intervals: the span is the kernels' (first start to last end); idle is the part
    of it in which neither a kernel nor a copy runs."""
    if not spans:
        return {"span_us": 0.0, "idle_us": 0.0, "overlap_us": 0.0, "copy_us": 0.0}
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    inside = [(max(s, lo), min(e, hi)) for s, e in copies if e > lo and s < hi]
    busy = _union(spans)
    return {"span_us": float(hi - lo), "idle_us": float(hi - lo - _union(list(spans) + inside)),
            "overlap_us": float(sum(e - s for s, e in spans) - busy),
            "copy_us": float(sum(e - s for s, e in copies))}
