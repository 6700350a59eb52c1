import pytest
import torch

pytest.importorskip("triton")

from blitzllm.kernels.activation import (  # noqa: E402
    reference_silu_and_mul, silu_and_mul, silu_and_mul_triton)
from blitzllm.kernels.norm.rmsnorm import (  # noqa: E402
    fused_add_rms_norm, fused_add_rms_norm_triton, reference_fused_add_rms_norm,
    reference_rms_norm, rms_norm, rms_norm_triton)
from tests.kernels.conftest import assert_close_ulps  # noqa: E402

# Scaled to the reference (tests/kernels/conftest.py): each element within ULPS ulps of
# max|ref|, and the mean error within MEAN_EPS of the dtype's relative spacing. The kernels
# accumulate in fp32 and round as the references do (the interpreter rounds to nearest even,
# as the GPU), so half-precision results are the reference's to the last bit but for rare
# ties: 1 ulp, and a quarter of one on average, catch an error under one bf16 ulp (the
# variance over N + 1: test_tolerance_rejects_norm_off_by_one). fp32: the sum's order.
ULPS = {torch.float32: 8, torch.float16: 1, torch.bfloat16: 1}
MEAN_EPS = {torch.float32: 2.0, torch.float16: 0.25, torch.bfloat16: 0.25}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
RMS_SHAPES = [(1, 64), (7, 96), (3, 5, 128)]
FUSED_SHAPES = [(1, 64), (33, 80)]


def close(a, b, dtype):
    assert_close_ulps(a, b, dtype, ulps=ULPS[dtype], mean_ulps=MEAN_EPS[dtype])


def rms_inputs(shape, dtype, device="cpu"):
    x = (torch.randn(shape) * 3).to(device, dtype)
    w = (1 + 0.5 * torch.randn(shape[-1])).to(device, dtype)
    return x, w


def fused_inputs(shape, dtype, device="cpu"):
    x = torch.randn(shape).to(device, dtype)
    r = (torch.randn(shape) * 4).to(device, dtype)
    w = (1 + 0.5 * torch.randn(shape[-1])).to(device, dtype)
    return x, r, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RMS_SHAPES)
def test_rms_norm(shape, dtype, device):
    x, w = rms_inputs(shape, dtype, device)
    out = rms_norm_triton(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    close(out, reference_rms_norm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", FUSED_SHAPES)
def test_fused_add_rms_norm(shape, dtype, device):
    x, r, w = fused_inputs(shape, dtype, device)
    out, res = fused_add_rms_norm_triton(x, r, w, 1e-5)
    ref_out, ref_res = reference_fused_add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(res, ref_res)
    close(out, ref_out, dtype)
    # HF semantics: residual add in the model dtype, then LlamaRMSNorm
    hf_res = x + r
    xf = hf_res.float()
    hf = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    close(out, hf, dtype)


@pytest.mark.parametrize("fp32_weight", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_add_rms_norm_fp32_input(dtype, fp32_weight, device):
    """An fp32 x beside a lower-precision residual (an MoE block's unrounded sum) is rounded
    to the residual's dtype first: the Triton kernel and the dispatcher on any device give
    the results of the rounded x, in the residual's dtype; also with an fp32 weight (the
    hybrid models' (1 + w) norms, ``OffsetRMSNorm``)."""
    x = (torch.randn(3, 96) * 2).to(device)
    r = (torch.randn(3, 96) * 4).to(device, dtype)
    w = (1 + 0.5 * torch.randn(96)).to(device, torch.float32 if fp32_weight else dtype)
    ref_out, ref_res = reference_fused_add_rms_norm(x.to(dtype), r, w, 1e-5)
    for fn in (fused_add_rms_norm_triton, fused_add_rms_norm):
        out, res = fn(x, r, w, 1e-5)
        assert out.dtype == res.dtype == dtype
        assert torch.equal(res, ref_res)
        close(out, ref_out, dtype)


def test_rms_norm_strided_rows(device):
    big = torch.randn(5, 256, device=device)
    x = big[:, :128]  # rows with stride 256
    w = torch.rand(128, device=device) + 0.5
    close(rms_norm_triton(x, w, 1e-6), reference_rms_norm(x, w, 1e-6), torch.float32)


def rms_norm_var_over_n_plus_1(x, w, eps):
    """A plausible RMSNorm bug: the variance divided by N + 1 (the output 1/(2N) too large:
    0.4% at N = 128, under the bf16 spacing of 0.4-0.8%)."""
    xf = x.float()
    var = xf.pow(2).sum(-1, keepdim=True) / (x.shape[-1] + 1)
    return (w.float() * (xf * torch.rsqrt(var + eps)).to(x.dtype).float()).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RMS_SHAPES)
def test_tolerance_rejects_norm_off_by_one(shape, dtype):
    """The check test_rms_norm applies, on test_rms_norm's inputs, rejects the N + 1 norm in
    every case (bf16: by its mean error, no element being over an ulp off)."""
    x, w = rms_inputs(shape, dtype)
    ref = reference_rms_norm(x, w, 1e-6)
    with pytest.raises(AssertionError):
        close(rms_norm_var_over_n_plus_1(x, w, 1e-6), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", FUSED_SHAPES)
def test_tolerance_rejects_fused_norm_off_by_one(shape, dtype):
    """Likewise test_fused_add_rms_norm's check on its inputs."""
    x, r, w = fused_inputs(shape, dtype)
    ref_out, ref_res = reference_fused_add_rms_norm(x, r, w, 1e-5)
    with pytest.raises(AssertionError):
        close(rms_norm_var_over_n_plus_1(ref_res, w, 1e-5), ref_out, dtype)


def test_dispatch_cpu_uses_reference():
    x, w = torch.randn(3, 64), torch.rand(64)
    assert torch.equal(rms_norm(x, w, 1e-6), reference_rms_norm(x, w, 1e-6))
    out, res = fused_add_rms_norm(x, None, w, 1e-6)
    assert res is x
    g = torch.randn(2, 8)
    assert torch.equal(silu_and_mul(g), reference_silu_and_mul(g))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 128), (7, 2 * 96), (2, 3, 2 * 64), (3, 2 * 3000)])
def test_silu_and_mul(shape, dtype, device):
    x = (torch.randn(shape) * 3).to(device, dtype)
    out = silu_and_mul_triton(x)
    assert out.shape == shape[:-1] + (shape[-1] // 2,)
    close(out, reference_silu_and_mul(x), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_norm_act_bf16():
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(1000, 4096, device=dev, dtype=dt)
    r = torch.randn(1000, 4096, device=dev, dtype=dt)
    w = torch.rand(4096, device=dev, dtype=dt) + 0.5
    close(rms_norm(x, w, 1e-6), reference_rms_norm(x, w, 1e-6), dt)
    o, nr = fused_add_rms_norm(x, r, w, 1e-6)
    ro, rr = reference_fused_add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(nr, rr)
    close(o, ro, dt)
    g = torch.randn(513, 2 * 12288, device=dev, dtype=dt)
    close(silu_and_mul(g), reference_silu_and_mul(g), dt)
