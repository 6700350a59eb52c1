"""The one-shot all-reduce + residual + RMSNorm kernel against its torch reference. The
"ranks' buffers" are tensors of one device whose addresses go in the pointer table, as
symmetric memory's peer addresses do on a multi-GPU host (the interpreter on CPU)."""
import pytest
import torch

pytest.importorskip("triton")

from blitzllm.kernels.norm.allreduce_rmsnorm import (  # noqa: E402
    oneshot_allreduce_rms_norm_triton, reference_allreduce_add_rms_norm)

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2}


def _run(partials, residual, w, eps):
    ptrs = torch.tensor([p.data_ptr() for p in partials], dtype=torch.int64, device=partials[0].device)
    rows, n = partials[0].shape
    return oneshot_allreduce_rms_norm_triton(ptrs, rows, n, residual, w, eps, partials[0].dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world,rows,n", [(2, 1, 64), (2, 7, 96), (3, 5, 80), (4, 2, 128)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_oneshot_allreduce_rms_norm(world, rows, n, dtype, with_residual, device):
    partials = [torch.randn(rows, n).to(device, dtype) for _ in range(world)]
    residual = (torch.randn(rows, n) * 3).to(device, dtype) if with_residual else None
    w = (1 + 0.5 * torch.randn(n)).to(device, dtype)
    out, res = _run(partials, residual, w, 1e-6)
    ref_out, ref_res = reference_allreduce_add_rms_norm(partials, residual, w, 1e-6)
    assert out.shape == res.shape == (rows, n) and out.dtype == res.dtype == dtype
    torch.testing.assert_close(res.float(), ref_res.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out.float(), ref_out.float(), atol=TOL[dtype] * 2, rtol=TOL[dtype] * 2)

