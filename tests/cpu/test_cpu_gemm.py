"""kernels/cpu_gemm: oneDNN's packed bf16 weights give F.linear's products bit for bit, at
decode's and prefill's row counts, with and without a bias, on 2-D and 3-D inputs; weights it
does not take (fp32) are left unpacked."""
import torch

from blitzllm.kernels import cpu_gemm


def test_packed_linear_equals_f_linear():
    g = torch.Generator().manual_seed(0)
    for N, K in ((96, 64), (200, 576), (49, 48)):
        w = torch.randn(N, K, generator=g).bfloat16()
        b = torch.randn(N, generator=g).bfloat16()
        wp = cpu_gemm.pack(w)
        assert wp is not None
        for rows in (1, 3, 16, 130):
            x = torch.randn(rows, K, generator=g).bfloat16()
            assert torch.equal(cpu_gemm.linear(x, wp), cpu_gemm.reference_linear(x, w))
            assert torch.equal(cpu_gemm.linear(x, wp, b), cpu_gemm.reference_linear(x, w, b))
        x3 = torch.randn(2, 5, K, generator=g).bfloat16()
        assert torch.equal(cpu_gemm.linear(x3, wp), cpu_gemm.reference_linear(x3, w))
    assert cpu_gemm.pack(torch.randn(8, 16)) is None
