"""Block-FP8 weights (kernels/fp8_weights.py): quantization against DeepSeek's per-block recipe;
the FP8 linear kernel and the MoE grouped GEMMs with FP8 experts (direct and sorted paths,
ragged blocks and tiles, dropped ids) against their torch references: the weights
dequantized, then the 16-bit math."""
import pytest
import torch

pytest.importorskip("triton")

from blitzllm.kernels.fp8_weights import (  # noqa: E402
    FP8_DTYPE, dequantize, fp8_linear_triton, quantize_fp8_block, reference_fp8_linear)
from blitzllm.kernels.moe.experts import fused_moe_triton  # noqa: E402
from blitzllm.kernels.moe.router import reference_fused_moe, reference_select_experts  # noqa: E402
from tests.kernels.conftest import sm90_compile  # noqa: E402
from tests.models.test_fp8_checkpoints import quantize_block, reference_dequant  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def close(out, ref, tol):
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


@pytest.mark.parametrize("shape,block", [((40, 72), (16, 32)), ((3, 33, 20), (8, 16)), ((256, 128), (128, 128))])
def test_quantize_matches_the_per_block_recipe(shape, block):
    torch.manual_seed(1)
    w = torch.randn(shape) * torch.rand(shape[:-1] + (1,)) * 4
    w[..., :block[0], :block[1]] = 0  # an all-zero block: scale 1, values 0
    q, s = quantize_fp8_block(w, block)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    for i, m in enumerate(w.reshape(-1, *shape[-2:])):
        rq, rs = quantize_block(m, block)
        rs = torch.where(rs > 1e-12 / 448.0, rs, torch.ones_like(rs))
        assert torch.equal(s.reshape(-1, *s.shape[-2:])[i], rs)
        assert torch.equal(q.reshape(-1, *shape[-2:])[i].float(), rq.float())
        torch.testing.assert_close(dequantize(q, s, block, torch.float32).reshape(-1, *shape[-2:])[i],
                                   reference_dequant(rq, rs, block))
    # quantizing the dequantized values again gives them back
    q2, s2 = quantize_fp8_block(dequantize(q, s, block, torch.float32), block)
    assert torch.equal(q2.float(), q.float()) and torch.equal(s2, s)


def test_pow2_scales():
    """``pow2``: every scale a power of two, each block's largest value in (224, 448], and the
    per-block recipe's values."""
    torch.manual_seed(2)
    w = torch.randn(48, 64) * torch.rand(48, 1) * 3
    q, s = quantize_fp8_block(w, (16, 32), pow2=True)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    amax = q.float().abs().view(3, 16, 2, 32).amax(dim=(1, 3))
    assert bool(((amax > 224) & (amax <= 448)).all())
    rq, rs = quantize_block(w, (16, 32), pow2=True)
    assert torch.equal(s, rs) and torch.equal(q.float(), rq.float())


def _linear_inputs(m, n, k, block, dtype, device, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_fp8_block(torch.randn(n, k, generator=g) / k ** 0.5, block)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return (x.to(device, dtype), q.to(device), s.to(device), None if b is None else b.to(device, dtype))


@pytest.mark.parametrize("m,n,k,block,bias", [
    (1, 40, 64, (16, 32), False),     # ragged N tile
    (2, 96, 72, (32, 32), True),      # ragged K (72 = 2 x 32 + 8), bias
    (5, 33, 48, (8, 16), False),      # ragged scale rows (33 = 4 x 8 + 1)
    (17, 64, 256, (128, 128), True),  # two row tiles, one scale block of rows
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_reference(m, n, k, block, bias, dtype, device):
    x, q, s, b = _linear_inputs(m, n, k, block, dtype, device, bias, seed=m + n)
    out = fp8_linear_triton(x, q, s, block, b, sms=4)
    assert out.shape == (m, n) and out.dtype == dtype
    close(out, reference_fp8_linear(x, q, s, block, b), TOL[dtype])
    y3 = fp8_linear_triton(x.view(1, m, k), q, s, block, b, sms=4)  # leading dims kept
    assert y3.shape == (1, m, n)


def moe_fp8_inputs(t, e, k, h, inter, block, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    q13, s13 = quantize_fp8_block(torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5, block)
    q2, s2 = quantize_fp8_block(torch.randn(e, h, inter, generator=g) / inter ** 0.5, block)
    weights, ids = reference_select_experts(torch.randn(t, e, generator=g), k)
    dev = [v.to(device) for v in (q13, q2, s13, s2, weights, ids)]
    return x.to(device, dtype), dev[0], dev[1], (dev[2], dev[3], block), dev[4], dev[5]


@pytest.mark.parametrize("t,e,k,h,inter,block,cfg", [
    (1, 8, 2, 64, 40, (16, 32), {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}),  # gate/up split inside a block
    (3, 6, 3, 48, 24, (8, 16), {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16}),
    (2, 8, 8, 64, 40, (16, 16), None),  # the heuristic's K tile narrowed to the block
    (17, 4, 2, 48, 24, (16, 16), {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16}),  # several blocks per expert
])
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_fp8_matches_reference(t, e, k, h, inter, block, cfg, direct, dtype, device):
    x, q13, q2, scales, weights, ids = moe_fp8_inputs(t, e, k, h, inter, block, dtype, device, seed=t + k)
    want = reference_fused_moe(x, q13, q2, weights, ids, scales=scales)
    w13 = dequantize(q13, scales[0], block, dtype)
    w2 = dequantize(q2, scales[1], block, dtype)
    torch.testing.assert_close(want, reference_fused_moe(x, w13, w2, weights, ids))  # what the scales mean
    out = fused_moe_triton(x, q13, q2, weights, ids, config=cfg, direct=direct, scales=scales)
    assert out.shape == (t, h) and out.dtype == dtype
    close(out, want, TOL[dtype])
    dropped = torch.where(ids % 2 == 0, ids, -1)
    w = weights * (dropped >= 0)
    out = fused_moe_triton(x, q13, q2, w, dropped, config=cfg, direct=direct, dropped_ids=True, scales=scales)
    close(out, reference_fused_moe(x, q13, q2, w, dropped, dropped_ids=True, scales=scales), TOL[dtype])


def test_fp8_kernels_compile_for_sm90():
    """The FP8 linear and the direct MoE GEMMs with float8 experts compile for sm_90 (a
    stand-in driver, as tools/ptxas_check.py) at Qwen3-30B-A3B sizes: the float8 tiles are
    widened by the hardware conversion, and nothing spills."""
    out = sm90_compile("fp8_weights()")
    rows = {ln.split(" ", 2)[0]: ln.split(" ", 2)[1:] for ln in out.strip().splitlines()}
    assert set(rows) == {"fp8_linear", "fp8_moe_up", "fp8_moe_down"}
    for name, (cvts, report) in rows.items():
        assert int(cvts) > 0 and "0 bytes spill stores" in report, (name, report)
