import pytest
import torch

pytest.importorskip("triton")

from blitzllm.kernels.activation import (  # noqa: E402
    reference_silu_and_mul, silu_and_mul, silu_and_mul_triton)
from blitzllm.kernels.rmsnorm import (  # noqa: E402
    fused_add_rms_norm, fused_add_rms_norm_triton, reference_fused_add_rms_norm,
    reference_rms_norm, rms_norm, rms_norm_triton)

# bf16: the interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest)
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def close(a, b, dtype, mult=1.0):
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype] * mult, rtol=TOL[dtype] * mult)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (3, 5, 128)])
def test_rms_norm(shape, dtype, device):
    x = (torch.randn(shape) * 3).to(device, dtype)
    w = (1 + 0.5 * torch.randn(shape[-1])).to(device, dtype)
    out = rms_norm_triton(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    close(out, reference_rms_norm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (33, 80)])
def test_fused_add_rms_norm(shape, dtype, device):
    x = torch.randn(shape).to(device, dtype)
    r = (torch.randn(shape) * 4).to(device, dtype)
    w = (1 + 0.5 * torch.randn(shape[-1])).to(device, dtype)
    out, res = fused_add_rms_norm_triton(x, r, w, 1e-5)
    ref_out, ref_res = reference_fused_add_rms_norm(x, r, w, 1e-5)
    if dtype == torch.bfloat16 and device == "cpu":  # interpreter rounds toward zero
        close(res, ref_res, dtype)
    else:
        assert torch.equal(res, ref_res)
    close(out, ref_out, dtype)
    # HF semantics: residual add in the model dtype, then LlamaRMSNorm
    hf_res = x + r
    xf = hf_res.float()
    hf = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    close(out, hf, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_add_rms_norm_fp32_input(dtype, device):
    """An fp32 x beside a lower-precision residual (an MoE block's unrounded sum) is rounded
    to the residual's dtype first: the Triton kernel and the dispatcher on any device give
    the results of the rounded x, in the residual's dtype."""
    x = (torch.randn(3, 96) * 2).to(device)
    r = (torch.randn(3, 96) * 4).to(device, dtype)
    w = (1 + 0.5 * torch.randn(96)).to(device, dtype)
    ref_out, ref_res = reference_fused_add_rms_norm(x.to(dtype), r, w, 1e-5)
    for fn in (fused_add_rms_norm_triton, fused_add_rms_norm):
        out, res = fn(x, r, w, 1e-5)
        assert out.dtype == res.dtype == dtype
        if dtype == torch.bfloat16 and device == "cpu" and fn is fused_add_rms_norm_triton:
            close(res, ref_res, dtype)  # (the interpreter rounds toward zero)
        else:
            assert torch.equal(res, ref_res)
        close(out, ref_out, dtype)


def test_rms_norm_strided_rows(device):
    big = torch.randn(5, 256, device=device)
    x = big[:, :128]  # rows with stride 256
    w = torch.rand(128, device=device) + 0.5
    close(rms_norm_triton(x, w, 1e-6), reference_rms_norm(x, w, 1e-6), torch.float32)


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
    close(out, reference_silu_and_mul(x), dtype, mult=2)


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
    close(silu_and_mul(g), reference_silu_and_mul(g), dt, mult=2)
