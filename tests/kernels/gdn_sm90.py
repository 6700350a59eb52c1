"""The GDN post-conv kernel's sm_90 compile, for tests/kernels/test_kernel_gdn.py (imported in
the compile subprocess; kept apart from the test module, whose conftest import would turn the
Triton interpreter on)."""
import torch

from blitzllm.kernels.gdn import post_conv


def print_post_conv_sm90(pc):
    """For the sm_90 compile check (run by ``sm90_compile`` with tools/ptxas_check.py as
    ``pc``): the post-conv kernel at Qwen3-Next-80B-A3B and Qwen3.5-397B-A17B sizes and at a test
    config's (dk != dv: the q/k and v branches then hold blocks of different sizes), bf16, one
    line each: name, ptxas report."""
    bf = torch.bfloat16
    for name, hk, dk, hv, dv in (("qwen3_next", 16, 128, 32, 128), ("qwen3_5_397b", 16, 128, 64, 128),
                                   ("dk_ne_dv", 2, 16, 4, 8)):
        C = 2 * hk * dk + hv * dv
        x, ab = torch.zeros(1, C + hv * dv, dtype=bf), torch.zeros(1, 2 * hv, dtype=bf)
        state, w = torch.zeros(2, 3, C, dtype=bf), torch.zeros(C, 4, dtype=bf)
        slots, p = torch.zeros(1, dtype=torch.int32), torch.zeros(hv)
        q, v, g = torch.zeros(1, hk, dk, dtype=bf), torch.zeros(1, hv, dv, dtype=bf), torch.zeros(1, hv)
        kern = post_conv._post_conv_decode_kernel.warmup(
            x, x.stride(0), ab, ab.stride(0), ab, ab.stride(0), state, state.stride(0), state.stride(1), slots,
            w, w, p, p, q, q, v, g, g, hk, hv, dk, dv, 1e-6, KW=4, BLOCK_DK=dk, BLOCK_DV=dv, HAS_BIAS=False,
            num_warps=2, grid=(1, hk + hv))
        print(f"{name} {pc.ptxas_report(kern)}")
