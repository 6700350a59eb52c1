"""The kernel tests' harness (tests/kernels/conftest.py): the ``device`` fixture fails, never
skips, without CUDA and without a usable Triton interpreter; the interpreter rounds fp32 ->
bf16 to nearest even as the GPU does; ``assert_close_ulps`` passes exact and last-ulp
results and rejects a systematic error below one ulp."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.kernels.conftest import assert_close_ulps, ulp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_device_fixture_fails_without_an_interpreter(tmp_path):
    """A triton that cannot be imported (a broken install or upgrade) on a machine without
    CUDA: a test taking ``device`` fails with the reason, it is not skipped."""
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("raise ImportError('triton broken on purpose')\n")
    (tmp_path / "test_uses_device.py").write_text(textwrap.dedent("""
        def test_kernel(device):
            pass
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]), CUDA_VISIBLE_DEVICES="",
               TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.kernels.conftest",
                        "--rootdir", str(tmp_path), "-c", os.devnull, "-rfs", str(tmp_path / "test_uses_device.py")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "1 error" in out and "skipped" not in out, out  # (a fixture failing: an error at setup)
    assert "no CUDA and no usable Triton interpreter" in out, out


def test_interpreter_rounds_bf16_to_nearest_even(device):
    """fp32 -> bf16 in a kernel, by ``.to`` and by a store into a bf16 tensor, gives torch's
    conversion bit for bit (round to nearest even): ties both ways, just off ties, carries
    into the exponent, overflow to inf, subnormals, signed zeros, inf and NaN."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, y_ptr, z_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(y_ptr + offs, x.to(tl.bfloat16), mask=mask)
        tl.store(z_ptr + offs, x, mask=mask)  # (cast by the store)

    g = torch.Generator().manual_seed(0)
    upper = torch.randint(0, 1 << 15, (64,), generator=g, dtype=torch.int32) << 16  # positive bf16 values
    low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x0001, 0xFFFF, 0x0000], dtype=torch.int32)  # tie, around it
    bits = (upper[:, None] | low[None, :]).flatten()
    x = torch.cat([bits.view(torch.float32), -bits.view(torch.float32),
                   torch.randn(500, generator=g) * 10.0 ** torch.randint(-30, 30, (500,), generator=g),
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4028235e38, -3.4028235e38,
                                 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 2.0 - 2 ** -9, 1e-40, -1e-40, 1e-45])])
    want = x.to(torch.bfloat16)
    y = torch.empty(x.numel(), dtype=torch.bfloat16, device=device)
    z = torch.empty_like(y)
    cast[(1,)](x.to(device), y, z, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    for got in (y.cpu(), z.cpu()):
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)
        bad = (got.view(torch.int16) != want.view(torch.int16)) & ~nan
        assert not bad.any(), (x[bad][:8].tolist(), got[bad][:8].tolist(), want[bad][:8].tolist())


def test_ulp():
    assert float(ulp(torch.bfloat16, 3.0)) == 2 ** -6
    assert float(ulp(torch.bfloat16, 1.0)) == 2 ** -7
    assert float(ulp(torch.float16, 0.3)) == 2 ** -12
    assert float(ulp(torch.float32, 1.5)) == 2 ** -23


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_assert_close_ulps(dtype):
    g = torch.Generator().manual_seed(1)
    ref = (torch.randn(64, 128, generator=g) * 2).to(dtype)
    assert_close_ulps(ref.clone(), ref)
    one_off = ref.clone()
    one_off.view(torch.int16)[3, 5] += 1  # one element one ulp away
    assert_close_ulps(one_off, ref)
    with pytest.raises(AssertionError, match="ulp of max"):
        assert_close_ulps(ref.float() + 2.5 * ulp(dtype, ref.float().abs().max()), ref.float(), dtype)
    # half an eps too large everywhere (bf16: 0.4%): no element more than an ulp off, most of
    # them rounded to the reference's own value or one ulp past it; the mean gives it away
    eps = torch.finfo(dtype).eps
    with pytest.raises(AssertionError, match="systematic"):
        assert_close_ulps((ref.float() * (1 + eps / 2)).to(dtype), ref)
