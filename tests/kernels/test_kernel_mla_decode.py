import pytest
import torch

pytest.importorskip("triton")

from blitzllm.kernels.attention.mla_decode import (  # noqa: E402
    mla_config, mla_decode, mla_decode_triton, reference_mla_decode)

TOL = {torch.float32: 1e-4, torch.bfloat16: 2.5e-2}


def make_mla(seq_lens, h, r, p, bs, dtype, device="cpu", spare=2):
    """Random latent cache with shuffled block tables (one spare column each), and
    q_latent / q_rope as the two halves of one [B, H, R + P] tensor (strided views, as
    a model that projects both at once would pass them)."""
    need = [(n + bs - 1) // bs for n in seq_lens]
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks)
    tables = torch.zeros(len(seq_lens), max(need) + 1, dtype=torch.int32)
    i = 0
    for b, nb in enumerate(need):
        tables[b, :nb] = perm[i:i + nb].int()
        i += nb
    cache = torch.randn(num_blocks, bs, 1, r + p).to(device, dtype)
    q = torch.randn(len(seq_lens), h, r + p).to(device, dtype)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q[..., :r], q[..., r:], cache, tables.to(device), seq


def check(seq_lens, h, r, p, bs, dtype, device, config=None):
    ql, qr, cache, tables, seq = make_mla(seq_lens, h, r, p, bs, dtype, device)
    scale = (r + p) ** -0.5
    ref = reference_mla_decode(ql, qr, cache, tables, seq, scale)
    out = mla_decode_triton(ql, qr, cache, tables, seq, scale, config=config)
    assert out.dtype == ql.dtype and out.shape == ql.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


CASES = [  # seq_lens, H, R, P, block_size, dtype
    ([1], 1, 32, 16, 16, torch.float32),
    ([15, 16, 17], 3, 64, 16, 16, torch.float32),
    ([100, 1, 1], 16, 64, 16, 16, torch.bfloat16),  # padded batch rows: seq_len 1
    ([17, 100], 16, 32, 16, 32, torch.float32),
    ([33, 64, 5], 3, 64, 16, 64, torch.bfloat16),
]


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("case", CASES)
def test_mla_decode(case, splits, device):
    check(*case, device=device, config={"SPLITS": splits})


def test_mla_decode_heuristic_config(device):
    # the launcher's own choice (nominal 8 SMs off-GPU -> 8 splits at batch 1)
    check([100], 3, 64, 16, 16, torch.bfloat16, device)


def test_mla_decode_head_blocks_and_uneven_splits(device):
    # 20 heads in two blocks of 16 (the second mostly padding); 7 tiles over 3 splits
    check([100, 40], 20, 32, 16, 16, torch.float32, device,
          config={"BLOCK_H": 16, "BLOCK_N": 16, "SPLITS": 3})


def test_mla_decode_non_pow2_dims(device):
    # R pads to 256: the combine takes it in two 128-wide chunks, the second part padding
    check([23, 9], 5, 136, 24, 16, torch.float32, device, config={"SPLITS": 2})
    check([23, 9], 2, 32, 8, 16, torch.float32, device, config={"SPLITS": 2})  # P pads to 16


def test_mla_decode_empty_sequence_gives_zeros(device):
    ql, qr, cache, tables, seq = make_mla([20, 1], 3, 32, 16, 16, torch.float32, device)
    seq[1] = 0
    for splits in (1, 2):
        out = mla_decode_triton(ql, qr, cache, tables, seq, 0.1, config={"SPLITS": splits})
        ref = reference_mla_decode(ql, qr, cache, tables, seq, 0.1)
        assert torch.isfinite(out).all() and (out[1] == 0).all()
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_mla_config_fills_the_gpu_once():
    def plan(B, H, max_ctx=32768, **over):
        cfg = mla_config(B, H, 512, max_ctx, 132, over)
        return cfg["BLOCK_H"], cfg["SPLITS"], cfg["num_warps"]
    # DeepSeek-V3's 128 heads on 132 SMs: 64-head programs, one per SM, one wave
    assert plan(1, 128) == (64, 66, 8)
    assert plan(8, 128)[1] == 8 and plan(32, 128)[1] == 2 and plan(64, 128)[1] == 1
    # 16 heads (8-way tensor parallel): two 16-head programs per SM, at most 128 splits
    assert plan(1, 16) == (16, 128, 4) and plan(8, 16)[1] == 33
    assert plan(1, 32) == (32, 128, 8) and plan(4, 32)[1] == 33  # 8 warps: one per SM
    assert mla_config(1, 128, 512, 32768, 132, fp32=True)["BLOCK_H"] == 16
    assert plan(1, 128, max_ctx=64)[1] == 2  # never more splits than tiles
    assert plan(1, 128, max_ctx=64, SPLITS=5, BLOCK_N=16)[1] == 4


def test_public_dispatch_cpu():
    ql, qr, cache, tables, seq = make_mla([9, 30], 2, 32, 16, 16, torch.float32)
    assert torch.equal(mla_decode(ql, qr, cache, tables, seq, 0.2),
                       reference_mla_decode(ql, qr, cache, tables, seq, 0.2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("h", [128, 16])
def test_gpu_mla_decode_deepseek_shapes(h):
    seq_lens = [1, 17, 300, 4096, 1000, 33]
    ql, qr, cache, tables, seq = make_mla(seq_lens, h, 512, 64, 16, torch.bfloat16, "cuda")
    ref = reference_mla_decode(ql, qr, cache, tables, seq, 192 ** -0.5)
    out = mla_decode(ql, qr, cache, tables, seq, 192 ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    graph = torch.cuda.CUDAGraph()  # capturable: no host sync, and replays stay right
    with torch.cuda.graph(graph):
        out_g = mla_decode(ql, qr, cache, tables, seq, 192 ** -0.5)
    graph.replay()
    torch.testing.assert_close(out_g.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("sparse", [False, True])
def test_mla_fp8_cache(sparse, device):
    """An fp8 (e4m3) latent cache under bf16 queries (kv_cache_dtype="fp8"): the kernel widens the
    latents to bf16 (exactly) and multiplies in bf16, so it matches the fp32 reference over the
    same fp8 latents within the bf16 tolerance; the sparse form too (a dot in fp8, with the
    queries cast to the cache's dtype as for 16-bit caches, is off by several times that)."""
    from blitzllm.kernels.attention.sparse_mla import reference_sparse_mla, sparse_mla_triton
    ql, qr, cache, tables, seq = make_mla([15, 70, 33], 16, 64, 16, 16, torch.bfloat16, device)
    cache = (cache * 4).to(torch.float8_e4m3fn)
    ql, qr, scale = ql * 4, qr * 4, 80 ** -0.5
    if not sparse:
        ref = reference_mla_decode(ql, qr, cache, tables, seq, scale)
        out = mla_decode_triton(ql, qr, cache, tables, seq, scale, config={"SPLITS": 2})
    else:
        g = torch.Generator().manual_seed(3)
        idx = torch.stack([torch.cat([torch.randperm(int(n), generator=g)[:12], torch.full((12,), -1)])[:12]
                           for n in seq.tolist()]).int().to(device)
        ref = reference_sparse_mla(ql, qr, cache, tables, idx, scale)
        out = sparse_mla_triton(ql, qr, cache, tables, idx, scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
