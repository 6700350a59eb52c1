"""DeepSeek-V3.2's sparse-attention kernels against their torch references (under TRITON_INTERPRET=1
on a CPU): the indexer prep and logits over the paged key cache, the top-k selection (rows shorter
than k, exactly k, ties, every method by row length) and sparse MLA through the block table
(-1 padding, block boundaries, splits); the three chained; sm_90 compiles."""
import pytest
import torch

pytest.importorskip("triton")

from blitzllm.kernels.attention import indexer as ix  # noqa: E402
from blitzllm.kernels.attention import sparse_mla as sm  # noqa: E402
from blitzllm.kernels.attention import topk as tk  # noqa: E402
from blitzllm.kernels.attention.mla_decode import reference_mla_decode  # noqa: E402
from blitzllm.layers.rotary import build_cos_sin_cache  # noqa: E402
from tests.kernels.conftest import INTERPRET, sm90_compile  # noqa: E402
from tests.kernels.test_kernel_mla_decode import make_mla  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 2.5e-2}


# ---- indexer prep ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("heads,dim,rope", [(16, 32, 8), (5, 24, 16), (1, 16, 16)])
def test_indexer_prep(dtype, interleave, heads, dim, rope, device):
    T, bs = 6, 4
    cs = build_cos_sin_cache(rope, 128, 10000.0).to(device)
    q = torch.randn(T, heads, dim + 3).to(device, dtype)[..., :dim]     # strided heads, as a GEMM slice
    k = torch.randn(T, dim + 5).to(device, dtype)[:, 2:2 + dim]
    pos = torch.tensor([0, 3, 17, 100, 5, 64], device=device)
    slots = torch.tensor([3, -1, 10, 7, 0, 15], device=device)           # -1: a padding row
    w, b = torch.randn(dim).to(device), torch.randn(dim).to(device)
    got_cache = torch.randn(4, bs, 1, dim).to(device, dtype)
    ref_cache = got_cache.clone()
    got = ix.indexer_prep_triton(q, k, pos, cs, w, b, 1e-6, got_cache, slots, interleave)
    ref = ix.reference_indexer_prep(q, k, pos, cs, w, b, 1e-6, ref_cache, slots, interleave)
    assert got.shape == ref.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got_cache.float(), ref_cache.float(), atol=TOL[dtype], rtol=TOL[dtype])


# ---- indexer logits -------------------------------------------------------------------------------

def _logits_case(lens, heads, dim, bs, dtype, device):
    """(q, w, key cache, shuffled block tables, lens): make_mla's latent cache as the key cache."""
    q, _, cache, tables, L = make_mla(lens, heads, dim, 0, bs, dtype, device)
    return q, torch.randn(len(lens), heads, device=device), cache, tables, L


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,heads,dim,bs,splits", [
    ([1], 16, 16, 16, 0),
    ([15, 16, 17, 64, 65], 12, 24, 16, 3),     # block and tile boundaries; heads and dim not powers of 2
    ([200, 3, 129], 64, 32, 32, 1),            # one program walks every tile
    ([200, 3, 129], 64, 32, 32, 0),            # the launcher's split count
])
def test_indexer_logits(dtype, lens, heads, dim, bs, splits, device):
    q, w, cache, tables, L = _logits_case(lens, heads, dim, bs, dtype, device)
    width = tables.shape[1] * bs
    got = ix.indexer_logits_triton(q, w, cache, tables, L, width, splits=splits)
    ref = ix.reference_indexer_logits(q, w, cache, tables, L, width)
    valid = torch.arange(width, device=device)[None, :] < L[:, None]
    assert torch.isinf(ref[~valid]).all()
    scale = ref[valid].abs().max()
    torch.testing.assert_close(got[valid] / scale, ref[valid] / scale, atol=TOL[dtype] / 10, rtol=0)


# ---- top-k ------------------------------------------------------------------------------------------

def _check_topk(x, lens, k, block=0, chunk=0):
    got = tk.topk_triton(x, lens, k, block, chunk)
    ref = tk.reference_topk(x, lens, k)
    assert torch.equal(got.cpu(), ref.cpu()), (got, ref)
    return ref


# (block, chunk): rows past a 32-wide tile spread over 32- or 16-wide chunks; 0: the defaults,
# where every row of these tests fits one program.
TILES = [(32, 32), (32, 16), (0, 0)]


@pytest.mark.parametrize("block,chunk", TILES)
def test_topk_every_method_and_padding(block, chunk, device):
    """k = 8: rows shorter than k, exactly k (all, in order, then -1), k + 1, one tile, exactly
    one tile, one past it (a second chunk of one key) and many chunks."""
    k = 8
    lens = [1, 5, 8, 9, 20, 32, 33, 64, 65, 150]
    x = torch.randn(len(lens), 160, device=device)
    L = torch.tensor(lens, dtype=torch.int32, device=device)
    ref = _check_topk(x, L, k, block, chunk)
    assert ref[1].tolist() == [0, 1, 2, 3, 4, -1, -1, -1] and ref[2].tolist() == list(range(8))
    assert (ref[3:] >= 0).all()


@pytest.mark.parametrize("block,chunk", [(16, 16), (16, 32), (16, 8), (0, 0)])
def test_topk_ties_go_to_the_lower_position(block, chunk, device):
    """Exact ties (the ReLU zeros of the indexer: +0 and -0 alike, the k-th value among them),
    a row all equal, negative values, and k not a power of two; with small chunks the tied keys
    spread over several chunks, and the ones taken must be the first in the row."""
    k = 6
    x = torch.randn(6, 100, device=device)
    x[0] = torch.where(torch.rand(100, device=device) < 0.5, 0.0, -0.0)       # +0 / -0 only
    x[1, ::2] = 0.0                                                            # half the row tied at 0
    x[2] = 1.5                                                                 # all equal
    x[3] = -x[3].abs()                                                         # all negative
    x[4, 40:] = x[4, :60].clone()                                              # duplicated values
    x[5, :] = torch.randint(-2, 3, (100,), device=device).float()             # few distinct values
    L = torch.tensor([100, 77, 50, 99, 100, 33], dtype=torch.int32, device=device)
    ref = _check_topk(x, L, k, block, chunk)
    assert ref[0].tolist() == list(range(6)) and ref[2].tolist() == list(range(6))


def test_topk_long_rows(device):
    """DeepSeek-V3.2's k = 2048 over rows up to 128K (32 chunks of the default 4096) and one just
    past k; row 0's wide tie straddles the k-th value and three chunks."""
    x = torch.randn(3, 131072, device=device)
    x[0, 1000:9000] = 2.5
    _check_topk(x, torch.tensor([131072, 50000, 2049], dtype=torch.int32, device=device), 2048)


# ---- sparse MLA -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("lens,h,r,p,bs,k", [
    ([1, 7, 8, 9], 3, 32, 16, 4, 8),             # rows with fewer selected than k (-1 padding), exactly k
    ([17, 64, 100], 20, 64, 16, 16, 16),          # two head blocks; block boundaries
    ([300, 33], 16, 32, 16, 32, 64),
])
def test_sparse_mla(dtype, splits, lens, h, r, p, bs, k, device):
    ql, qr, cache, tables, L = make_mla(lens, h, r, p, bs, dtype, device)
    idx = tk.reference_topk(torch.randn(len(lens), tables.shape[1] * bs, device=device), L, k)
    got = sm.sparse_mla_triton(ql, qr, cache, tables, idx, 0.2, config={"SPLITS": splits})
    ref = sm.reference_sparse_mla(ql, qr, cache, tables, idx, 0.2)
    assert got.dtype == dtype and got.shape == (len(lens), h, r)
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_sparse_mla_selecting_everything_is_dense_mla(device):
    """Rows of at most k tokens select all of them: the sparse reference equals MLA decode's."""
    ql, qr, cache, tables, L = make_mla([1, 5, 16, 13], 4, 32, 16, 4, torch.float32, device)
    idx = tk.reference_topk(torch.randn(4, tables.shape[1] * 4, device=device), L, 16)
    torch.testing.assert_close(sm.reference_sparse_mla(ql, qr, cache, tables, idx, 0.3),
                               reference_mla_decode(ql, qr, cache, tables, L, 0.3), atol=1e-5, rtol=1e-5)


def test_indexer_topk_sparse_mla_chained(device):
    """The decode path of a layer, kernels end to end: logits over the key cache -> top-k -> sparse
    MLA, against the chained references (bf16 caches; ties between near-equal logits are kept
    out by comparing with the reference's selection on the kernel's own logits)."""
    lens, heads, dim, bs, k = [3, 40, 97], 16, 32, 8, 16
    q, w, keys, tables, L = _logits_case(lens, heads, dim, bs, torch.bfloat16, device)
    width = tables.shape[1] * bs
    logits = ix.indexer_logits_triton(q, w, keys, tables, L, width)
    idx = tk.topk_triton(logits, L, k)
    assert torch.equal(idx, tk.reference_topk(logits.masked_fill(
        torch.arange(width, device=device)[None, :] >= L[:, None], float("-inf")), L, k))
    lat = torch.randn(keys.shape[0], bs, 1, 48).to(device, torch.bfloat16)
    ql = torch.randn(len(lens), 4, 48).to(device, torch.bfloat16)
    got = sm.sparse_mla_triton(ql[..., :32], ql[..., 32:], lat, tables, idx, 0.2)
    ref = sm.reference_sparse_mla(ql[..., :32], ql[..., 32:], lat, tables, idx, 0.2)
    torch.testing.assert_close(got.float(), ref.float(), atol=2.5e-2, rtol=2.5e-2)


def test_dsa_kernels_compile_for_sm90():
    """The indexer prep and logits, the top-k and the sparse MLA split kernel compile for sm_90
    (the stand-in driver of tools/ptxas_check.py) at DeepSeek-V3.2's sizes, without spills."""
    out = sm90_compile("ptxas_report\nfrom tests.kernels.dsa_sm90 import print_dsa_sm90\nprint_dsa_sm90(pc)")
    rows = dict(ln.split(" ", 1) for ln in out.strip().splitlines())
    assert set(rows) == {"indexer_prep", "indexer_logits", "topk_hist", "topk_count", "topk_write",
                         "sparse_mla"}, out
    for name, report in rows.items():
        assert "registers" in report and "0 bytes spill stores" in report, (name, report)


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels on CPU tensors (the interpreter's test); on a "
                    "GPU tests/models/test_deepseek_v32_gpu.py runs them in the engine")
def test_model_attention_on_the_triton_kernels(tmp_path, monkeypatch):
    """A tiny DeepSeek-V3.2 whose attention runs every Triton kernel of the CUDA path (MLA prep and
    decode, indexer prep and logits, top-k, sparse MLA) under the interpreter, prefill and decode
    past index_topk, batched: the torch path's greedy tokens and logprobs."""
    from blitzllm import LLM, SamplingParams
    from blitzllm.kernels.attention import mla_decode
    from blitzllm.layers import mla
    from tests.models.test_deepseek_v32 import _prompts, make_tiny_v32
    make_tiny_v32(tmp_path, seed=2, num_hidden_layers=2)
    prompts, params = _prompts((5, 20), seed=4), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    kw = dict(device="cpu", dtype="float32", kv_cache_blocks=32, block_size=4)
    want = LLM(str(tmp_path), **kw).generate(prompts, params)
    calls = []
    for mod in (ix, tk, sm, mla_decode, mla):
        monkeypatch.setattr(mod, "use_triton", lambda t, _m=mod.__name__: calls.append(_m) or True)
    got = LLM(str(tmp_path), **kw).generate(prompts, params)
    assert {"blitzllm.kernels.attention.topk", "blitzllm.kernels.attention.sparse_mla"} <= set(calls)
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        for da, db in zip(a.logprobs, b.logprobs):
            torch.testing.assert_close(torch.tensor([db[t] for t in da]), torch.tensor(list(da.values())),
                                       atol=1e-4, rtol=1e-4)
