"""The GDN output norm (w * rmsnorm(x) * silu(z) per value head): the Triton kernel against
its torch reference (interpreter on the CPU, compiled on a GPU) on z as the layer makes it (a
row-strided view of the projection output), fp32 / bf16 / fp16, head sizes not a power of
two, no rows; the tolerance against plausible bugs; the entry point's dispatch; sm_90 compile."""
import pytest
import torch

from blitzllm.kernels import gdn
from blitzllm.kernels.gdn import norm_gated
from blitzllm.kernels.gdn.reference import reference_rms_norm_gated
from tests.kernels.conftest import HAS_CUDA, assert_close_ulps, assert_gdn_sm90_no_spills

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Scaled to max|ref| (tests/kernels/conftest.py). The kernel reduces in fp32 and rounds where the
# reference does (twice to x's dtype before the gate, once after), so half-precision outputs are
# the reference's but for rare ties: 1 ulp, a quarter of one on average (which catches a norm
# 0.4% off: test_tolerance_rejects_plausible_bugs). fp32: the sum's order and rsqrt.
ULPS = {torch.float32: 8, torch.float16: 1, torch.bfloat16: 1}
MEAN_EPS = {torch.float32: 2.0, torch.float16: 0.25, torch.bfloat16: 0.25}


def close(out, ref, dtype, what=""):
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape, what
    assert_close_ulps(out, ref, dtype, ulps=ULPS[dtype], mean_ulps=MEAN_EPS[dtype], what=what)


def _inputs(T, hv, D, dtype, device="cpu", scale=1.0, seed=0):
    """x as the rule's output [T, hv, D] (contiguous), z as the layer slices it out of the packed
    projection (rows of the projection's stride, heads contiguous inside a row), the weight in the
    model dtype. ``scale`` small: mean(x^2) near eps, where eps's placement shows."""
    g = torch.Generator().manual_seed(seed)
    C = 2 * 16 + hv * D  # q|k|v channels ahead of z, then b and a after
    proj = (torch.randn(T, C + hv * D + 2 * hv, generator=g) * 2).to(device, dtype)
    z = proj[:, C:C + hv * D].reshape(T, hv, D)
    x = (torch.randn(T, hv, D, generator=g) * scale).to(device, dtype)
    w = (1 + 0.5 * torch.randn(D, generator=g)).to(device, dtype)
    return x, z, w


SHAPES = [(5, 4, 128), (1, 3, 96), (33, 8, 128), (2, 1, 20)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,hv,D", SHAPES)
@pytest.mark.parametrize("scale", [1.0, 0.01])
def test_kernel_matches_reference_on_strided_z(device, T, hv, D, dtype, scale):
    """z a row-strided view of the projection (as RMSNormGated gets it), read without a copy."""
    x, z, w = _inputs(T, hv, D, dtype, device, scale)
    assert not z.is_contiguous() or T == 1
    out = norm_gated.rms_norm_gated_triton(x, z, w, EPS)
    close(out, reference_rms_norm_gated(x, z, w, EPS), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_other_layouts(device, dtype):
    """Rows [R, D], one row [D], more leading dims, contiguous z, and an fp32 weight beside a
    half-precision x (rounded to x's dtype, as the reference does)."""
    x, z, w = _inputs(6, 4, 96, dtype, device)
    cases = {"2d": (x.reshape(24, 96), z.reshape(24, 96), w), "1d": (x[2, 1], z[2, 1], w),
             "4d": (x.reshape(2, 3, 4, 96), z.contiguous().reshape(2, 3, 4, 96), w),
             "fp32 weight": (x, z, w.float() + 1e-3)}
    for what, (xx, zz, ww) in cases.items():
        close(norm_gated.rms_norm_gated_triton(xx, zz, ww, EPS), reference_rms_norm_gated(xx, zz, ww, EPS), dtype,
              what)


def test_kernel_no_rows(device):
    x, z, w = _inputs(0, 4, 128, torch.bfloat16, device)
    out = norm_gated.rms_norm_gated_triton(x, z, w, EPS)
    assert out.shape == (0, 4, 128) and out.dtype == torch.bfloat16


def test_heads_view_keeps_z_in_place():
    """The launcher's [T, H, D] view of the layer's z is z itself (no copy of the projection)."""
    _, z, _ = _inputs(5, 4, 128, torch.bfloat16)
    z3 = norm_gated._as_heads(z, 128)
    assert z3.data_ptr() == z.data_ptr() and z3.stride() == z.stride()


def _mutants():
    """Plausible bugs of the norm, each as the reference with the one change."""
    def make(mean_over=0, eps_outside=False, gate=torch.nn.functional.silu):
        def f(x, z, w, eps):
            dt, xf = x.dtype, x.float()
            ms = xf.pow(2).sum(-1, keepdim=True) / (x.shape[-1] + mean_over)
            inv = 1 / (ms.sqrt() + eps) if eps_outside else torch.rsqrt(ms + eps)
            return ((w.to(dt) * (xf * inv).to(dt)) * gate(z.float())).to(dt)
        return f
    return {"mean over D + 1": make(mean_over=1), "eps outside the sqrt": make(eps_outside=True),
            "sigmoid for silu": make(gate=torch.sigmoid)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,hv,D,scale", [(5, 4, 128, 1.0), (5, 4, 128, 0.01), (33, 8, 128, 0.01)])
def test_tolerance_rejects_plausible_bugs(T, hv, D, scale, dtype):
    """The check the kernel tests apply, on their inputs, rejects each mutant (the variance over
    D + 1 is 0.4% off, under a bf16 ulp: caught by the mean error; eps outside the sqrt only
    where mean(x^2) is near eps, as in the small-scale cases)."""
    x, z, w = _inputs(T, hv, D, dtype, scale=scale)
    ref = reference_rms_norm_gated(x, z, w, EPS)
    for name, f in _mutants().items():
        if name == "eps outside the sqrt" and scale == 1.0:
            continue
        with pytest.raises(AssertionError):
            close(f(x, z, w, EPS), ref, dtype, name)


def test_entry_point_dispatch(device, monkeypatch):
    """gdn.rms_norm_gated: the reference off CUDA (exactly); with the CUDA branch forced (the
    kernel, here on this device), the kernel, and ``reference=True`` still the reference."""
    x, z, w = _inputs(3, 4, 128, torch.bfloat16)
    ref = reference_rms_norm_gated(x, z, w, EPS)
    assert torch.equal(gdn.rms_norm_gated(x, z, w, EPS), ref)
    monkeypatch.setattr(gdn, "_on_gpu", lambda t, reference: not reference)
    xd, zd, wd = _inputs(3, 4, 128, torch.bfloat16, device)
    close(gdn.rms_norm_gated(xd, zd, wd, EPS), ref.to(device), torch.bfloat16)
    calls = []
    monkeypatch.setattr(norm_gated, "rms_norm_gated_triton", lambda *a: calls.append(a))
    assert torch.equal(gdn.rms_norm_gated(x, z, w, EPS, reference=True), ref) and not calls


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 3000])
def test_layer_sizes_on_gpu(T):
    """CUDA, through the entry point: Qwen3-Next's output norm (32 value heads of 128, bf16) at
    decode and prefill sizes, z strided as in the layer."""
    x, z, w = _inputs(T, 32, 128, torch.bfloat16, "cuda")
    close(gdn.rms_norm_gated(x, z, w, EPS), gdn.rms_norm_gated(x, z, w, EPS, reference=True), torch.bfloat16)


def test_norm_gated_kernel_compiles_for_sm90():
    """The kernel compiles for sm_90 (the stand-in driver of tools/ptxas_check.py) at the
    launcher's config for D = 128 and D = 96, bf16, without spills."""
    assert_gdn_sm90_no_spills("print_norm_gated_sm90", {"d128", "d96"})
