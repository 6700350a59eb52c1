"""kernels/cpu_quant and loader/gguf_grid: the codes read from the GGUF file give back exactly the
weights gguf-py dequantizes (q/k rows un-permuted as the float loader does); our AVX-512 kernel
equals the fp32 matmul with the dequantized weight (up to summation order), one row to many
(the prefill form), Q4_0 / Q4_1 / Q8_0; torch's int4 kernel (where ours does not build) equals
it up to its bf16 roundings."""
import pytest
import torch

from blitzllm.kernels.cpu_quant import native, pack_q4, pack_q8_blocks, quant_matmul, reference_dequantize
from blitzllm.kernels.cpu_quant.pack import MANY_ROWS


def _case(kind, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()   # (the file's scales: fp16)
    if kind == "q8":
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        return q, pack_q8_blocks(q, d), reference_dequantize(q, d, kind="q8")
    q = torch.randint(0, 16, (n, k), generator=g)
    m = None if kind == "q4_0" else (-torch.rand(n, k // 32, generator=g) * 0.15).half().float()
    return q, pack_q4(q, d, m), reference_dequantize(q, d, m)


@pytest.fixture(params=["ours", "torch"])
def kernel(request, monkeypatch):
    if request.param == "ours":
        if native.lib() is None:
            pytest.fail("our AVX-512 kernel did not build here (the CI machine has AVX-512 and gcc)")
    else:
        native.lib()
        monkeypatch.setitem(native._state, "lib", None)   # as where it does not build
    return request.param


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8"])
@pytest.mark.parametrize("n,k", [(64, 32), (112, 96), (256, 576)])  # (torch's int4 packing: N % 16 == 0)
def test_quant_matmul_matches_dequantized(kernel, kind, n, k):
    q, w, dense = _case(kind, n, k, n + k)
    assert (w.parts is None) == (kernel == "ours")
    assert torch.equal(w.dequantize(torch.float32), dense) and torch.equal(w.codes_int().long(), q.long())
    tol = 2e-6 if kernel == "ours" else 1e-2   # fp32 sums in another order / bf16 inputs and scales
    for rows in (1, 3, 5, MANY_ROWS + 5):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        ref = (x.double() @ dense.double().t()).float()
        got = quant_matmul(x, w)
        assert got.shape == ref.shape and got.dtype == x.dtype
        assert (got - ref).abs().max() <= tol * ref.abs().max(), (rows, (got - ref).abs().max())


@pytest.mark.parametrize("n", [1, 3, 17])   # row counts our kernel takes in pairs
def test_our_kernel_odd_shapes(n):
    assert native.lib() is not None
    for kind in ("q4_1", "q8"):
        q, w, dense = _case(kind, n, 64, n)
        for rows in (1, 2, 4, 7):
            x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
            ref = x.double() @ dense.double().t()
            assert ((quant_matmul(x, w).double() - ref).abs().max() <= 2e-6 * ref.abs().max()), (kind, n, rows)


def test_q4_rows_get_the_same_bits_in_every_build_and_batch():
    """The q4 kernel's two forms (AVX512-VBMI: two groups a byte permute; without: a group at a
    time) add in one order, and a row's result does not depend on the rows beside it: bit-equal
    outputs, for even and odd group counts, 1 to 6 activation rows, 1 to 5 weight rows."""
    from pathlib import Path

    from blitzllm.kernels import _cbuild
    if "avx512vbmi" not in _cbuild.cpu_flags():
        pytest.skip("this CPU has no AVX512-VBMI: one form only")
    src = Path(native.__file__).with_name("qgemm.c")
    libs = [_cbuild.load(src, native._FLAGS + extra, (), native._SIGNATURES) for extra in ((), ("-mavx512vbmi",))]
    assert all(lib is not None for lib in libs)
    for n, k in ((5, 576), (3, 96), (1, 1536), (4, 32)):   # (18, 3, 48 and 1 groups a row)
        _, w, _ = _case("q4_1", n, k, n * k)
        outs = []
        for lib in libs:
            for rows in (1, 2, 6):
                x = torch.randn(6, k, generator=torch.Generator().manual_seed(k))[:rows].contiguous()
                y = torch.empty(rows, n)
                assert lib.blitz_q4_gemm(x.data_ptr(), w.codes.data_ptr(), w.d.data_ptr(), w.m.data_ptr(),
                                         y.data_ptr(), rows, n, k, 2) == 0
                outs.append(y[:1])
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), (n, k)


def test_scales_must_be_fp16_values():
    with pytest.raises(ValueError, match="fp16"):
        pack_q4(torch.zeros(16, 32, dtype=torch.long), torch.full((16, 1), 0.1), None)


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


def test_bf16_weight_kernel_is_fp32_math():
    """A dense bf16 weight under fp32 activations (``--weight-dtype bfloat16``): each weight
    widened exactly, products and sums in fp32, through native.matmul and Linear."""
    from blitzllm.layers.linear import Linear
    assert native.lib() is not None
    g = torch.Generator().manual_seed(1)
    # (a batch of decode rows, up to MANY_ROWS - 1, takes the kernel through Linear too: a large
    # lm_head widened per step cost more than its GEMM)
    for n, k, rows in ((64, 32, 1), (96, 576, 3), (3, 64, 4), (50, 64, 16), (50, 64, MANY_ROWS - 1)):
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(rows, k, generator=g)
        ref = x.double() @ w.double().t()
        got = native.matmul(x, w, None, None)
        assert (got.double() - ref).abs().max() <= 1e-6 * ref.abs().max()
        lin = Linear(k, n)
        lin.weight = torch.nn.Parameter(w, requires_grad=False)
        assert torch.equal(lin(x), got)
    x = torch.randn(MANY_ROWS, 64, generator=g)  # prefill: the weight widened once, torch's fp32 GEMM
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight.float()))
