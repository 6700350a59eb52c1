"""kernels/cpu_quant and loader/gguf_grid: the codes read from the GGUF file give back exactly the
weights gguf-py dequantizes (q/k rows un-permuted as the float loader does), and the packed
matmul equals the dequantized weight's matmul up to the bf16 rounding of its inputs and scales,
one row to many (the prefill form), Q4_0 / Q4_1 / Q8_0."""
import pytest
import torch

from blitzllm.kernels.cpu_quant import int4_matmul, pack_q4, pack_q8_blocks, reference_dequantize, reference_matmul
from blitzllm.kernels.cpu_quant.pack import MANY_ROWS


def _case(kind, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    if kind == "q8":
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        return pack_q8_blocks(q, d), reference_dequantize(q, d, kind="q8")
    q = torch.randint(0, 16, (n, k), generator=g)
    m = None if kind == "q4_0" else -torch.rand(n, k // 32, generator=g) * 0.15
    return pack_q4(q, d, m), reference_dequantize(q, d, m)


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8"])
@pytest.mark.parametrize("n,k", [(64, 32), (112, 96), (256, 576)])  # (the kernel: N % 16 == 0)
def test_packed_matmul_matches_dequantized(kind, n, k):
    w, dense = _case(kind, n, k, n + k)
    assert torch.allclose(w.dequantize(torch.float32), dense, rtol=2 ** -8, atol=2 ** -8 * dense.abs().max())
    for rows in (1, 3, MANY_ROWS + 5):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        ref, got = reference_matmul(x, dense), int4_matmul(x, w)
        assert got.shape == ref.shape and got.dtype == x.dtype
        assert (got - ref).abs().max() <= 1e-2 * ref.abs().max(), (rows, (got - ref).abs().max())


def test_grid_codes_equal_gguf_dequantized(smollm2_gguf):
    from blitzllm.loader.gguf_file import iter_gguf_tensors, open_gguf
    from blitzllm.loader.gguf_grid import read_grids
    reader, cfg = open_gguf(smollm2_gguf)
    names = {"model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
             "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight"}
    grids = read_grids(reader, cfg, names)
    assert set(grids) == names
    floats = {n: t for n, t in iter_gguf_tensors(reader, cfg, skip=frozenset()) if n in names}
    for name, (kind, q, d, m) in grids.items():
        assert torch.equal(reference_dequantize(q, d, m, kind), floats[name]), name
