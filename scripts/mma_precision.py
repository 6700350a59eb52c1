"""The TMA GEMV's two forms (FMA, tensor cores) against an fp64 product of the same bf16 inputs:
per shape and row count, how many bf16 outputs differ from the rounded exact product and from each
other, and each form's largest error relative to the largest output. Usage (Hopper):
python3 scripts/mma_precision.py"""
import torch

from blitzllm.kernels import gemv_tma

torch.manual_seed(0)
for N, K in ((2048, 4096), (5120, 2048)):
    for M in (1, 2):
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        exact = x.double() @ w.double().t()
        fma = gemv_tma.gemv_tma_triton(x, w, mma=False)
        mma = gemv_tma.gemv_tma_triton(x, w, mma=True)
        ref = exact.to(torch.bfloat16)
        print(f"N {N} K {K} M {M}: outputs differing from the rounded exact product: fma "
              f"{(fma != ref).sum().item()} mma {(mma != ref).sum().item()} of {ref.numel()}; fma vs mma "
              f"{(fma != mma).sum().item()}; max |out - exact| / max|exact|: fma "
              f"{((fma.double() - exact).abs().max() / exact.abs().max()).item():.3e} mma "
              f"{((mma.double() - exact).abs().max() / exact.abs().max()).item():.3e}")
