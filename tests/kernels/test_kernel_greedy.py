"""The fused greedy-sampling kernel (argmax + its log-softmax) against torch."""
import pytest
import torch

from blitzllm.kernels.greedy import greedy_sample_triton, reference_greedy_sample


@pytest.mark.parametrize("B,V,splits", [(1, 5000, None), (3, 1031, 4), (2, 49152, None), (5, 300, 1),
                                        (1, 4097, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_matches_torch(B, V, splits, dtype, device):
    g = torch.Generator().manual_seed(B * 1000 + V)
    x = (torch.randn(B, V, generator=g) * 4).to(device, dtype)
    for _ in range(2):   # the second launch finds clean counters
        tok, lp = greedy_sample_triton(x, splits)
        rt, rl = reference_greedy_sample(x)
        assert torch.equal(tok.cpu(), rt.cpu())
        torch.testing.assert_close(lp.cpu(), rl.cpu(), atol=1e-5, rtol=1e-5)


def test_greedy_ties_pick_the_first_index_and_masked_slices(device):
    """Ties across lanes and slices go to the lowest index (torch.argmax); a slice of only
    -inf (banned) values contributes nothing to the normaliser."""
    V = 3000
    x = torch.full((2, V), -5.0)
    x[0, [7, 1500, 2999]] = 3.0        # the same max in three slices
    x[1, :2048] = float("-inf")        # whole slices removed
    x[1, [2100, 2500]] = 1.0
    x = x.to(device)
    tok, lp = greedy_sample_triton(x, splits=3)
    rt, rl = reference_greedy_sample(x)
    assert tok.cpu().tolist() == [7, 2100] == rt.cpu().tolist()
    torch.testing.assert_close(lp.cpu(), rl.cpu(), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled kernels)")
def test_one_compiled_kernel_for_every_row_count():
    """Speculative verify steps call it with a different row count each step: the split
    count per row must not be a compile-time constant, or each new count recompiles."""
    from blitzllm.kernels.greedy import _greedy_kernel
    def compiled():  # variants so far in this process (other tests may have added some)
        return sum(len(c[0]) for c in _greedy_kernel.device_caches.values())
    x = torch.randn(64, 32000, device="cuda", dtype=torch.bfloat16)
    greedy_sample_triton(x[:2])
    before = compiled()
    for b in (1, 3, 4, 7, 12, 29, 64):   # 264 SMs' worth of splits: 132 ... 5 per row
        tok, _ = greedy_sample_triton(x[:b])
        assert torch.equal(tok.cpu(), x[:b].float().argmax(-1).cpu())
    assert compiled() == before, (before, compiled())
