#!/usr/bin/env python3
"""Whether the fused decode kernel compiled with L2 prefetch ranges holds the bulk prefetch
instruction (one small launch on the GPU, then a look at every compiled variant's PTX)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import blitzllm.kernels.paged_attention as pa  # noqa: E402

dev, dt = "cuda", torch.bfloat16
hq, hkv, d, bs, ctx = 16, 8, 128, 16, 100
nblk = ctx // bs + 2
kc = torch.randn(nblk, bs, hkv, d, device=dev, dtype=dt)
vc = torch.randn_like(kc)
tables = torch.arange(nblk, device=dev, dtype=torch.int32)[None]
seq = torch.tensor([ctx], device=dev, dtype=torch.int32)
pos = (seq - 1).long()
qkv = torch.randn(1, (hq + 2 * hkv) * d, device=dev, dtype=dt)
f = torch.arange(ctx + 1, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)[None]
cs = torch.cat([f.cos(), f.sin()], -1).to(dev)
w = torch.randn(4096, 1024, device=dev, dtype=dt)
ranges = [(w, w.numel() * 2)]
print("NPF the launcher passes:", pa._prefetch_args(qkv, ranges, 256)["NPF"])
pa.fused_decode_attention_triton(qkv, pos, cs, hq, hkv, d, kc, vc, pos, tables, seq, d ** -0.5,
                                 l2_prefetch_ranges=ranges)
torch.cuda.synchronize()
for c in pa._decode_kernel.device_caches.values():
    for key, k in c[0].items():
        ptx = k.asm.get("ptx", "")
        npf = k.src.constants.get("NPF") if hasattr(k, "src") and hasattr(k.src, "constants") else "?"
        print("variant NPF", npf, "prefetch in PTX:", "cp.async.bulk.prefetch.L2" in ptx, "PTX chars", len(ptx))
