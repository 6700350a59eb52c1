"""The one-launch decode MLP (kernels/fused_mlp.py) against the unfused numerics: gate_up
rounded to the dtype, silu rounded, product rounded, then down_proj; slices that do not
divide the intermediate, odd hidden sizes, one and two rows, the workspace and counter left
clean for the next launch."""
import pytest
import torch

from blitzllm.kernels.fused_mlp import fused_mlp_ok, fused_mlp_triton, reference_fused_mlp

CASES = [  # M, H, I, config
    (1, 64, 96, None),
    (2, 48, 40, {"SLICE": 8}),          # 5 slices, H not a power of two
    (1, 40, 70, {"SLICE": 16, "BLOCK_K": 16, "BLOCK_N": 16}),  # ragged slice, several K / N tiles
    (2, 130, 33, {"SLICE": 32, "BLOCK_N": 64}),  # one ragged slice, H past two N tiles
]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_fused_mlp_matches_unfused(case, dtype, device):
    M, H, I, cfg = case
    g = torch.Generator().manual_seed(H * 7 + I)
    x = torch.randn(M, H, generator=g).to(device, dtype)
    wgu = (torch.randn(2 * I, H, generator=g) / H ** 0.5).to(device, dtype)
    wd = (torch.randn(H, I, generator=g) / I ** 0.5).to(device, dtype)
    ref = reference_fused_mlp(x, wgu, wd)
    for _ in range(2):  # the second launch finds a clean workspace and counter
        out = fused_mlp_triton(x, wgu, wd, config=cfg)
        torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_fused_mlp_shape_checks():
    x = torch.randn(1, 8)
    wgu, wd = torch.randn(12, 8), torch.randn(8, 6)
    assert fused_mlp_ok(x, wgu, wd)
    assert not fused_mlp_ok(torch.randn(3, 8), wgu, wd)            # more rows than the kernel takes
    assert not fused_mlp_ok(x, wgu, torch.randn(8, 5))             # down's width is not I
    assert not fused_mlp_ok(x, wgu.to(torch.bfloat16), wd)         # mixed dtypes
    assert not fused_mlp_ok(x, torch.randn(8, 12).t(), wd)         # a transposed (column-major) gate_up


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_dense_mlp_runs_fused_when_enabled(monkeypatch):
    """DenseMLP and the post-attention block take the one-launch MLP for 1-2 rows when
    BLITZ_FUSED_MLP is on (patched here), the unfused path otherwise, with the same result."""
    import blitzllm.models.llama as llama
    from blitzllm.layers.norm import RMSNorm
    torch.manual_seed(0)
    mlp = llama.DenseMLP(256, 640).cuda().to(torch.bfloat16)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.05)
    norm = RMSNorm(256).cuda().to(torch.bfloat16)
    x, res = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16), torch.randn(2, 256, device="cuda",
                                                                                 dtype=torch.bfloat16)
    monkeypatch.setattr(llama, "FUSED_MLP", False)
    assert not mlp.fused_ok(x)
    want, want_res = llama.mlp_forward_norm(mlp, x, res, norm)
    monkeypatch.setattr(llama, "FUSED_MLP", True)
    assert mlp.fused_ok(x) and not mlp.fused_ok(torch.randn(3, 256, device="cuda", dtype=torch.bfloat16))
    got, got_res = llama.mlp_forward_norm(mlp, x, res, norm)
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
