"""``kernels/lora/bgmv.py``: the decode LoRA kernels (shrink, then expand into the base product)
and the masked torch form, each against a per-row loop that indexes each row's slot directly
(a third way to write the same sums); rows of slot -1 get nothing. Shapes off the kernels'
block sizes; the interpreter on a CPU, the GPU where there is one; and the sm_90 compile."""
import pytest
import torch

pytest.importorskip("triton")

from blitzllm.kernels.lora.bgmv import (  # noqa: E402
    MAX_KERNEL_ROWS, lora_add_, lora_expand_triton_, lora_shrink_triton, reference_lora_add_)
from tests.kernels.conftest import assert_close_ulps, sm90_compile  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def _inputs(rows, k, n, sr, slots, dtype, device):
    x = torch.randn(rows, k).to(device, dtype)
    a = (torch.randn(slots, sr, k) * 0.1).to(device, dtype)
    b = (torch.randn(slots, sr, n) * 0.1).to(device, dtype)
    y = torch.randn(rows, n).to(device, dtype)
    return x, a, b, y


def _per_row(y, x, a, b, slots):
    """fp32 sums row by row from the row's own slot (the oracle), rounded once into y's dtype."""
    out = y.float().clone()
    xa = torch.zeros(x.shape[0], a.shape[1])
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            xa[i] = x[i].float().cpu() @ a[s].float().cpu().t()
    xa = xa.to(x.dtype).float()   # (the shrink's output is stored in the activation dtype)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            out[i] += (xa[i] @ b[s].float().cpu()).to(out.device)
    return xa.to(x.dtype), out.to(y.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,n,sr", [(1, 300, 200, 24), (5, 64, 130, 48), (MAX_KERNEL_ROWS, 520, 96, 16)])
def test_shrink_and_expand(rows, k, n, sr, dtype, device):
    x, a, b, y = _inputs(rows, k, n, sr, 3, dtype, device)
    slots = torch.tensor([(i % 4) - 1 for i in range(rows)], device=device)   # -1, 0, 1, 2, -1, ...
    want_xa, want_y = _per_row(y, x, a, b, slots)
    xa = lora_shrink_triton(x, a, slots)
    ulps = 8 if dtype == torch.float32 else 1
    assert_close_ulps(xa, want_xa, dtype, ulps=ulps, mean_ulps=2.0 if dtype == torch.float32 else 0.25)
    assert (xa[slots < 0] == 0).all()
    base = y.clone()
    got = lora_expand_triton_(y, want_xa, b, slots)
    assert got.data_ptr() == y.data_ptr()   # in place
    assert torch.equal(got[slots < 0], base[slots < 0])
    assert_close_ulps(got, want_y, dtype, ulps=ulps, mean_ulps=2.0 if dtype == torch.float32 else 0.25)


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_form_and_the_dispatcher(dtype):
    """The torch form (every row through all slots, a one-hot mask) equals the per-row oracle,
    also past MAX_KERNEL_ROWS; on a CPU the dispatcher takes it."""
    rows = MAX_KERNEL_ROWS + 3
    x, a, b, y = _inputs(rows, 72, 40, 24, 2, dtype, "cpu")
    slots = torch.tensor([(i % 3) - 1 for i in range(rows)])
    _, want = _per_row(y, x, a, b, slots)
    tol = dict(ulps=8, mean_ulps=2.0) if dtype == torch.float32 else dict(ulps=2, mean_ulps=0.5)
    assert_close_ulps(reference_lora_add_(y.clone(), x, a, b, slots), want, dtype, **tol)
    assert_close_ulps(lora_add_(y.clone(), x, a, b, slots), want, dtype, **tol)


def test_lora_kernels_compile_for_sm90():
    """Both kernels compile for sm_90 at Llama-3.1-8B's qkv sizes without spills."""
    out = sm90_compile("lora()")
    rows = dict(ln.split(" ", 1) for ln in out.strip().splitlines())
    assert set(rows) == {"lora_shrink", "lora_expand"}
    for name, report in rows.items():
        assert "registers" in report and "0 bytes spill stores" in report, (name, report)
