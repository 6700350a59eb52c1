"""The GDN kernels' sm_90 compiles (post-conv, recurrent rule, output norm), for
tests/kernels/test_kernel_gdn.py (imported in the compile subprocess; kept apart from the test
module, whose conftest import would turn the Triton interpreter on)."""
import torch

from blitzllm.kernels.gdn import norm_gated, post_conv, recurrent


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
            x, x.stride(0), ab, ab.stride(0), ab, ab.stride(0), state, state.stride(0), state.stride(1), slots, slots,
            w, w, p, p, q, q, v, g, g, hk, hv, dk, dv, 1e-6, KW=4, BLOCK_DK=dk, BLOCK_DV=dv, HAS_BIAS=False,
            num_warps=2, grid=(1, hk + hv))
        print(f"{name} {pc.ptxas_report(kern)}")


def print_recurrent_sm90(pc):
    """The in-place recurrent rule kernel at Qwen3-Next-80B-A3B and Qwen3.5-397B-A17B sizes, bf16
    q / k / v, fp32 states: one line each, name and ptxas report."""
    bf = torch.bfloat16
    for name, hk, hv in (("qwen3_next", 16, 32), ("qwen3_5_397b", 16, 64)):
        q, v = torch.zeros(1, hk, 128, dtype=bf), torch.zeros(1, hv, 128, dtype=bf)
        g, state, slots = torch.zeros(1, hv), torch.zeros(2, hv, 128, 128), torch.zeros(1, dtype=torch.int32)
        kern = recurrent._recurrent_decode_kernel.warmup(
            q, q, v, g, g, state, slots, slots, v, q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0),
            state.stride(0), 0.088, hk, hv, 128, 128, BLOCK_K=128, BLOCK_V=8, num_warps=1, grid=(hv * 16,))
        print(f"{name} {pc.ptxas_report(kern)}")


def print_norm_gated_sm90(pc):
    """The output norm at the launcher's config for D = 128 and D = 96 (bf16, 32 heads, z a view
    of the projection): one line each, name and ptxas report."""
    for D in (128, 96):
        x = torch.zeros(4, 32, D, dtype=torch.bfloat16)
        proj = torch.zeros(4, 3 * 32 * D, dtype=torch.bfloat16)
        z, w = proj[:, 32 * D:64 * D].reshape(4, 32, D), torch.zeros(D, dtype=torch.bfloat16)
        kern = norm_gated._rms_norm_gated_kernel.warmup(
            x, z, w, x, 128, 32, D, x.stride(0), x.stride(1), z.stride(0), z.stride(1), 1e-6,
            ROWS=16, BLOCK_D=128, num_warps=4, grid=(8,))
        print(f"d{D} {pc.ptxas_report(kern)}")
