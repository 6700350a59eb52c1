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


def test_one_row_gemv_is_the_fp32_dot_rounded_once():
    """``gemv`` (one row, our AVX512-BF16 loop): each output is the fp32 dot product of the bf16
    values (+ bias) rounded once to bf16, as F.linear's, so it equals the exact sum's rounding
    but for summation order (1 ulp at most) and F.linear's within that; ragged K (masked loads)
    and N (a partial block) included; ``matmul`` takes it for one row and oneDNN's for more."""
    import pytest
    if cpu_gemm.gemv_lib() is None:
        pytest.skip("no AVX512-BF16 here")
    g = torch.Generator().manual_seed(1)
    for N, K in ((96, 64), (203, 576), (7, 45), (576, 1536)):
        w = torch.randn(N, K, generator=g).bfloat16()
        b = torch.randn(N, generator=g).bfloat16()
        x = torch.randn(1, K, generator=g).bfloat16()
        for bias in (None, b):
            got = cpu_gemm.gemv(x, w, bias)
            exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
            ulp = exact.abs().float().bfloat16().float() * 2.0 ** -7   # (an ulp bound of the rounded sum)
            assert got.shape == (1, N) and got.dtype == torch.bfloat16
            assert ((got.double() - exact).abs() <= ulp.double() * 1.01 + 1e-30).all(), (N, K)
            ref = cpu_gemm.reference_linear(x, w, bias)
            assert ((got.float() - ref.float()).abs() <= ulp * 1.01 + 1e-30).all(), (N, K)
            same = (got == ref).float().mean().item()
            assert same > 0.9, same
        wp = cpu_gemm.pack(w)
        assert torch.equal(cpu_gemm.matmul(x, w, wp, b), cpu_gemm.gemv(x, w, b))
        x3 = torch.randn(3, K, generator=g).bfloat16()
        assert torch.equal(cpu_gemm.matmul(x3, w, wp, b), cpu_gemm.reference_linear(x3, w, b))
    w[2, 3] = float("nan")   # a NaN sum stays NaN, as F.linear's (not rounded into another value)
    got = cpu_gemm.gemv(x, w)
    assert got[0, 2].isnan() and not got[0, 1].isnan()
