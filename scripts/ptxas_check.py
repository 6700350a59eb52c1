#!/usr/bin/env python3
"""Compile Triton kernels for sm_90 on a machine without a GPU (a stand-in driver gives
Triton the target; CPU tensors give it argument types and alignments) and print ptxas's
register / spill report and whether the PTX holds given instructions.

    python3 scripts/ptxas_check.py            # the fused decode MLP at Qwen3-0.6B / Llama-3.1-8B shapes
"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import triton  # noqa: E402
import triton.runtime.driver as drv  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402


class _Sm90:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_device_interface(self):
        return torch.cuda


def ptxas_report(kernel) -> str:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(kernel.asm["ptx"])
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    return " | ".join(line.split("info    : ")[-1].strip() for line in r.stderr.splitlines()
                      if "registers" in line or "spill" in line)


def fused_mlp():
    from blitzllm.kernels import fused_mlp as fm
    for M in (1, 2):
        for H, I in ((1024, 3072), (4096, 14336)):
            cfg = fm.fused_mlp_config(H, I, 132, M)
            bf = torch.bfloat16
            k = fm._fused_mlp_kernel.warmup(
                torch.zeros(M, H, dtype=bf), torch.zeros(2 * I, H, dtype=bf), torch.zeros(H, I, dtype=bf),
                torch.zeros(M, H, dtype=bf), torch.zeros(2 * H), torch.zeros(1, dtype=torch.int32), M, H, I, H, H,
                M_PAD=triton.next_power_of_2(M), SLICE=cfg["SLICE"], BLOCK_K=cfg["BLOCK_K"],
                BLOCK_N=cfg["BLOCK_N"], BLOCK_OUT=1024, USE_PDL=1, num_warps=cfg["num_warps"], num_stages=1,
                grid=(triton.cdiv(I, cfg["SLICE"]),))
            print(f"fused_mlp M={M} H={H} I={I} {cfg}: {ptxas_report(k)}")


if __name__ == "__main__":
    drv.set_active(_Sm90())
    fused_mlp()
