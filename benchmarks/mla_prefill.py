#!/usr/bin/env python3
"""MLA prefill attention over expanded latents at DeepSeek-V3's shapes (128 heads, latent 512,
rope 64, nope 128, v 128), bf16, one prompt of L tokens attending causally to itself, ms per
layer:

    python3 benchmarks/mla_prefill.py [--lens 4096,32768] [--chunk 8192]

- ``fused``: ``MLAttention.attend_fused`` (CUDA's prefill: one SDPA call with the causal mask
  aligned to the last query row; torch picks the backend, v's head dim differing from q's);
- ``fused_pad_v``: the same call with v always zero-padded to q's head dim (the flash backend's
  condition), the output sliced back (``fused`` pads only chunks after earlier context, where
  the unpadded call took the memory-efficient kernel at half flash's rate);
- ``rows``: ``attend_latents``, the torch reference (scores materialised in query-row chunks);
  only at L <= 8192, where it takes seconds, not minutes;
- with ``--chunk C``: the last C query rows over all L entries (a chunked prefill's last chunk).
Each against the FLOPs of the causal attention (2 * H * L^2 / 2 * (192 + 128)) at 989 TFLOP/s
(H100 SXM dense bf16). Prints a line per timing; writes $OUT/mla_prefill.json when OUT is set.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from blitzllm.layers.mla import MLADims, MLAttention  # noqa: E402

PEAK_TFLOPS = 989.0


def ms(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def pad_v(attn, q, kv):
    k, v = attn._expand(kv)
    v = torch.nn.functional.pad(v, (0, k.shape[-1] - v.shape[-1]))
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=causal_lower_right(q.shape[0], kv.shape[0]), scale=attn.scale)
    return o[0].transpose(0, 1)[..., :attn.d.v_head_dim]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="4096,32768")
    ap.add_argument("--chunk", type=int, default=8192)
    a = ap.parse_args()
    d = MLADims(hidden=7168, num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128)
    torch.manual_seed(0)
    with torch.device("cuda"):
        attn = MLAttention(d, 0, None, d.qk_head_dim ** -0.5).to(torch.bfloat16)
    torch.nn.init.normal_(attn.kv_b_proj.weight, std=0.05)
    rows = []
    for L in map(int, a.lens.split(",")):
        kv = torch.randn(L, d.cache_dim, device="cuda", dtype=torch.bfloat16)
        for Q in sorted({L, min(a.chunk, L)}, reverse=True):
            q = torch.randn(Q, d.num_heads, d.qk_head_dim, device="cuda", dtype=torch.bfloat16)
            qpos = torch.arange(L - Q, L, device="cuda")
            flops = 2 * d.num_heads * (Q * L - Q * Q / 2) * (d.qk_head_dim + d.v_head_dim)
            variants = {"fused": lambda: attn.attend_fused(q, kv), "fused_pad_v": lambda: pad_v(attn, q, kv)}
            if L <= 8192:
                variants["rows"] = lambda: attn.attend_latents(q, kv, qpos)
            ref = attn.attend_fused(q, kv).float()
            for name, fn in variants.items():
                try:
                    err = (fn().float() - ref).abs().max().item()
                    t = ms(fn, reps=1 if name == "rows" else 5)
                except torch.OutOfMemoryError:
                    print(json.dumps(dict(variant=name, L=L, Q=Q, error="out of memory")), flush=True)
                    continue
                rows.append(dict(variant=name, L=L, Q=Q, ms=round(t, 3), tflops=round(flops / t / 1e9, 1),
                                 of_peak=round(flops / t / 1e9 / PEAK_TFLOPS, 3), max_abs_diff=err))
                print(json.dumps(rows[-1]), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "mla_prefill.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
