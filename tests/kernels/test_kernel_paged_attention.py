import math

import pytest
import torch

pytest.importorskip("triton")

from blitzllm.kernels.attention.paged import (  # noqa: E402
    paged_decode_attention, paged_decode_attention_triton, paged_prefill_attention,
    paged_prefill_attention_triton, reference_paged_decode_attention,
    reference_paged_prefill_attention)
from tests.kernels.conftest import assert_close_ulps  # noqa: E402

TOL = {torch.float32: 1e-4}
# fp16 / bf16: scaled to the reference (tests/kernels/conftest.py): each element within 2 ulps
# of max|ref|, the mean error within half an eps. The kernels keep scores, softmax and sums in
# fp32 and round P to the KV dtype for P @ V: 1 ulp at most and ~0.15 eps on average here; a
# dropped 16-token block or a wrong scale is 7 eps or more (test_tolerance_rejects_*).
HALF_ULPS, HALF_MEAN_EPS = 2, 0.5


def close(out, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    else:
        assert_close_ulps(out, ref, dtype, ulps=HALF_ULPS, mean_ulps=HALF_MEAN_EPS)


def make_cache(seq_lens, hkv, d, bs, dtype, device="cpu", spare=3):
    """Random paged K/V with a shuffled, non-contiguous block table per sequence."""
    need = [(n + bs - 1) // bs for n in seq_lens]
    max_blocks = max(need) + 1
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    i = 0
    for b, nb in enumerate(need):
        tables[b, :nb] = perm[i:i + nb].int()
        i += nb
    kc = torch.randn(num_blocks, bs, hkv, d).to(device, dtype)
    vc = torch.randn(num_blocks, bs, hkv, d).to(device, dtype)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return kc, vc, tables.to(device), seq


DECODE = [  # seq_lens, Hq, Hkv, D, block_size
    ([1], 4, 4, 64, 16),
    ([16, 17, 32, 7], 6, 2, 64, 16),
    ([300], 3, 1, 128, 16),
    ([33, 64, 5], 4, 4, 64, 32),
    ([700, 5, 130], 4, 2, 32, 16),  # more tiles than splits: some splits idle, some long
]


@pytest.mark.parametrize("num_splits,fused_reduce", [(1, True), (4, True), (4, False)])
@pytest.mark.parametrize("case", DECODE)
def test_decode(case, num_splits, fused_reduce, device):
    seq_lens, hq, hkv, d, bs = case
    dtype = torch.float32
    kc, vc, tables, seq = make_cache(seq_lens, hkv, d, bs, dtype, device)
    q = torch.randn(len(seq_lens), hq, d).to(device, dtype)
    scale = 1 / math.sqrt(d)
    ref = reference_paged_decode_attention(q, kc, vc, tables, seq, scale)
    for _ in range(2):  # the second launch checks that the fused reduce left its counters at 0
        out = paged_decode_attention_triton(q, kc, vc, tables, seq, scale, num_splits=num_splits,
                                            fused_reduce=fused_reduce)
        torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("hq,hkv,d,per_round", [(16, 2, 64, 16), (16, 2, 128, 8), (32, 1, 256, 1)])
def test_decode_combine_rounds(hq, hkv, d, per_round, device):
    """The fused combine (8 warps: 8 or more query heads per KV head) over 10 active splits,
    taking their partials in one round (1024 values per warp: 16 splits of G 8, D 64), in two
    (8 splits of D 128) or one split a round (G 32, D 256): the same output."""
    import blitzllm.kernels.attention.paged as pa
    g = hq // hkv
    assert pa.decode_warps(g) == 8
    assert pa._COMBINE_ELEMS_PER_WARP * 8 // (g * d) == per_round  # the launcher's splits per round
    seq_lens = [300, 40]
    kc, vc, tables, seq = make_cache(seq_lens, hkv, d, 16, torch.float32, device)
    q = torch.randn(len(seq_lens), hq, d).to(device)
    ref = reference_paged_decode_attention(q, kc, vc, tables, seq, d ** -0.5)
    for _ in range(2):
        out = paged_decode_attention_triton(q, kc, vc, tables, seq, d ** -0.5, num_splits=16)
        torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def half_decode_case(dtype, device="cpu", seq_lens=(45, 3, 16), hq=6, hkv=2, d=64):
    kc, vc, tables, seq = make_cache(list(seq_lens), hkv, d, 16, dtype, device)
    q = torch.randn(len(seq_lens), hq, d).to(device, dtype)
    return q, kc, vc, tables, seq


LONG = dict(seq_lens=(4096, 300), hq=8, hkv=2, d=64)  # 4,096 tokens: |output| ~ 0.02


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half(dtype, device):
    q, kc, vc, tables, seq = half_decode_case(dtype, device)
    out = paged_decode_attention_triton(q, kc, vc, tables, seq, 0.125, num_splits=2, block_n=16)
    ref = reference_paged_decode_attention(q, kc, vc, tables, seq, 0.125)
    close(out, ref, dtype)


def test_decode_bf16_long_context(device):
    """4,096 keys in bf16 (the default splits): the outputs are small (mean |out| ~ 0.02, the
    old flat 2e-2), so the tolerance must scale with them to notice a missing block."""
    q, kc, vc, tables, seq = half_decode_case(torch.bfloat16, device, **LONG)
    out = paged_decode_attention_triton(q, kc, vc, tables, seq, 0.125)
    close(out, reference_paged_decode_attention(q, kc, vc, tables, seq, 0.125), torch.bfloat16)


@pytest.mark.parametrize("case", [{}, LONG], ids=["short", "4096"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tolerance_rejects_dropped_kv_block(dtype, case):
    """The check of test_decode_half / test_decode_bf16_long_context, on their inputs, rejects
    an attention that drops each sequence's last 16-token KV block (a 1-token sequence keeps
    its token)."""
    q, kc, vc, tables, seq = half_decode_case(dtype, **case)
    ref = reference_paged_decode_attention(q, kc, vc, tables, seq, 0.125)
    dropped = reference_paged_decode_attention(q, kc, vc, tables, (seq - 16).clamp(min=1), 0.125)
    with pytest.raises(AssertionError):
        close(dropped, ref, dtype)


@pytest.mark.parametrize("factor", [math.log(2), math.sqrt(64 / 128)], ids=["exp2_without_log2e", "padded_head_dim"])
@pytest.mark.parametrize("case", [{}, LONG], ids=["short", "4096"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tolerance_rejects_wrong_scale(dtype, case, factor):
    """Likewise a wrong softmax scale: exp2 of the scaled scores without log2(e) folded in
    (scale * ln 2), or 1/sqrt of a head dim padded to twice its size."""
    q, kc, vc, tables, seq = half_decode_case(dtype, **case)
    ref = reference_paged_decode_attention(q, kc, vc, tables, seq, 0.125)
    with pytest.raises(AssertionError):
        close(reference_paged_decode_attention(q, kc, vc, tables, seq, 0.125 * factor), ref, dtype)


def test_decode_empty_sequence_gives_zeros(device):
    kc, vc, tables, seq = make_cache([5, 1], 2, 64, 16, torch.float32, device)
    seq[1] = 0  # e.g. a padded CUDA-graph slot
    q = torch.randn(2, 2, 64, device=device)
    for s in (1, 2):
        out = paged_decode_attention_triton(q, kc, vc, tables, seq, 0.125, num_splits=s)
        ref = reference_paged_decode_attention(q, kc, vc, tables, seq, 0.125)
        assert torch.isfinite(out).all() and (out[1] == 0).all()
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def run_prefill(q_lens, ctx_lens, hq, hkv, d, bs, dtype, device="cpu", cache_dtype=None, **kw):
    kc, vc, tables, seq = make_cache(ctx_lens, hkv, d, bs, dtype, device)
    if cache_dtype is not None:
        kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    qsl = qsl.to(device)
    q = torch.randn(sum(q_lens), hq, d).to(device, dtype)
    scale = 1 / math.sqrt(d)
    out = paged_prefill_attention_triton(q, kc, vc, qsl, seq, tables, scale, max(q_lens), **kw)
    ref = reference_paged_prefill_attention(q, kc, vc, qsl, seq, tables, scale, max(q_lens))
    return out, ref


PREFILL = [  # q_lens, ctx_lens (incl. this chunk), Hq, Hkv, D, block_size
    ([1], [1], 4, 4, 64, 16),
    ([7], [7], 6, 2, 64, 16),
    ([16, 17, 5, 1], [16, 17, 21, 33], 6, 2, 64, 16),  # fresh + cached prefixes + decode row
    ([33, 2], [40, 300], 3, 1, 128, 16),
    ([32, 9], [32, 70], 4, 4, 64, 32),
]


@pytest.mark.parametrize("blocks", [{}, {"block_m": 16, "block_n": 16}])
@pytest.mark.parametrize("case", PREFILL)
def test_prefill(case, blocks, device):
    out, ref = run_prefill(*case, dtype=torch.float32, device=device, **blocks)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half(dtype, device):
    out, ref = run_prefill([9, 3], [9, 37], 6, 2, 64, 16, dtype, device, block_m=32, block_n=16)
    close(out, ref, dtype)


def test_prefill_matches_sdpa_for_fresh_sequence():
    """Independent check of the reference against torch SDPA (causal, no prefix)."""
    kc, vc, tables, seq = make_cache([20], 2, 64, 16, torch.float32)
    q = torch.randn(20, 4, 64)
    qsl = torch.tensor([0, 20], dtype=torch.int32)
    ref = reference_paged_prefill_attention(q, kc, vc, qsl, seq, tables, 0.125, 20)
    k = kc[tables[0, :2].long()].reshape(32, 2, 64)[:20].repeat_interleave(2, 1)
    v = vc[tables[0, :2].long()].reshape(32, 2, 64)[:20].repeat_interleave(2, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=0.125)
    torch.testing.assert_close(ref, sdpa.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_public_dispatch_cpu():
    kc, vc, tables, seq = make_cache([9], 2, 64, 16, torch.float32)
    q = torch.randn(1, 2, 64)
    assert torch.equal(paged_decode_attention(q, kc, vc, tables, seq, 0.1),
                       reference_paged_decode_attention(q, kc, vc, tables, seq, 0.1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (28, 4, 128), (16, 16, 64)])
def test_gpu_attention_bf16(hq, hkv, d):
    dt = torch.bfloat16
    seq_lens = [1, 17, 300, 4096, 1000, 33]
    kc, vc, tables, seq = make_cache(seq_lens, hkv, d, 16, dt, "cuda")
    q = torch.randn(len(seq_lens), hq, d, device="cuda", dtype=dt)
    out = paged_decode_attention(q, kc, vc, tables, seq, d ** -0.5)
    ref = reference_paged_decode_attention(q, kc, vc, tables, seq, d ** -0.5)
    close(out, ref, dt)
    dropped = reference_paged_decode_attention(q, kc, vc, tables, seq - 16 * (seq > 16), d ** -0.5)
    with pytest.raises(AssertionError):  # (the check notices a dropped last block here too)
        close(dropped, ref, dt)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    out = paged_prefill_attention(q[2:3], kc, vc, qsl, seq[2:3], tables[2:3], d ** -0.5, 1)
    close(out, ref[2:3], dt)
    out, ref = run_prefill([1, 700, 64, 2048], [900, 700, 1100, 2048], hq, hkv, d, 16, dt, "cuda")
    close(out, ref, dt)


FUSED = [  # seq_lens (context incl. the new token), Hq, Hkv, D, rotary_dim, block_size, norm, splits
    ([1], 4, 4, 64, 64, 16, True, 1),
    ([16, 17, 33], 6, 2, 64, 64, 16, True, 4),     # the new token at a block boundary / just past it
    ([300, 5], 3, 1, 128, 64, 16, False, 8),       # partial rotary, no norm, many splits
    ([45, 130, 2], 4, 2, 32, 32, 32, True, 2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", FUSED)
def test_fused_decode_matches_unfused_reference(case, dtype, device):
    """q/k norm + rotary + cache write + decode attention in one launch == the reference
    norm/rope/cache-write followed by the reference paged decode attention; the cache ends
    up identical, and a padding row (slot -1) writes nothing."""
    from blitzllm.kernels.attention.paged import fused_decode_attention_triton
    from blitzllm.kernels.attention.qk_norm_rope_cache import reference_qk_norm_rope_cache
    seq_lens, hq, hkv, d, rot, bs, norm, splits = case
    g = torch.Generator().manual_seed(len(seq_lens) * 7 + d)
    kc, vc, tables, seq = make_cache(seq_lens, hkv, d, bs, dtype, device)
    B = len(seq_lens)
    qkv = (torch.randn(B, (hq + 2 * hkv) * d, generator=g) * 2).to(device, dtype)
    pos = (seq.long() - 1)
    tab = tables.long().cpu()
    slots = torch.tensor([int(tab[b, p // bs]) * bs + p % bs for b, p in enumerate(pos.tolist())]).to(device)
    if B > 2:
        slots[2] = -1   # a padding row: its token is not written (it reads stale cache)
    inv = 1.0 / 10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    f = torch.arange(512, dtype=torch.float32)[:, None] * inv[None, :]
    cs = torch.cat([f.cos(), f.sin()], -1).to(device)
    qw = kw = None
    if norm:
        qw = (1 + 0.3 * torch.randn(d, generator=g)).to(device, dtype)
        kw = (1 + 0.3 * torch.randn(d, generator=g)).to(device, dtype)
    scale = 1 / math.sqrt(d)
    kr, vr = kc.clone(), vc.clone()
    q_ref = reference_qk_norm_rope_cache(qkv, pos, cs, hq, hkv, d, kr, vr, slots, qw, kw, 1e-6, rot)
    ref = reference_paged_decode_attention(q_ref, kr, vr, tables, seq, scale)
    for _ in range(2):  # the second launch finds its own writes and clean counters
        out = fused_decode_attention_triton(qkv, pos, cs, hq, hkv, d, kc, vc, slots, tables, seq, scale,
                                            qw, kw, 1e-6, rot, num_splits=splits)
        keep = slots >= 0
        close(out[keep], ref[keep], dtype)
        close(kc, kr, dtype)
        torch.testing.assert_close(vc, vr, atol=0, rtol=0)


def test_decode_warps_default():
    """8 warps per decode program from 8 query heads per KV head on, else 4."""
    from blitzllm.kernels.attention import paged as pa
    assert [pa.decode_warps(g) for g in (1, 2, 4, 6, 8, 16)] == [4, 4, 4, 4, 8, 8]


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("kind", ["decode", "prefill", "fused"])
def test_fp8_cache(kind, device):
    """An fp8 (e4m3) cache under bf16 queries (kv_cache_dtype="fp8"): the kernels widen its
    entries to bf16, exactly, so they match the fp32 references over the same fp8 values within
    the bf16 tolerance (a P @ V in fp8, or keys read as raw bytes, are far off); the fused decode
    writes the new token's k / v as the reference's ``to_cache`` does, byte for byte, a key
    past +-448 clamped, not NaN."""
    from blitzllm.kernels.attention.paged import fused_decode_attention_triton
    from blitzllm.kernels.attention.qk_norm_rope_cache import reference_qk_norm_rope_cache
    bf = torch.bfloat16
    if kind == "prefill":
        out, ref = run_prefill([9, 3], [9, 37], 6, 2, 64, 16, bf, device, block_m=32, block_n=16, cache_dtype=FP8)
        return close(out, ref, bf)
    seq_lens, hq, hkv, d, bs = [16, 17, 33], 6, 2, 64, 16
    kc, vc, tables, seq = make_cache(seq_lens, hkv, d, bs, bf, device)
    kc, vc = kc.to(FP8), vc.to(FP8)
    scale = 1 / math.sqrt(d)
    if kind == "decode":
        q = torch.randn(len(seq_lens), hq, d).to(device, bf)
        out = paged_decode_attention_triton(q, kc, vc, tables, seq, scale, num_splits=2)
        return close(out, reference_paged_decode_attention(q, kc, vc, tables, seq, scale), bf)
    g = torch.Generator().manual_seed(5)
    qkv = (torch.randn(len(seq_lens), (hq + 2 * hkv) * d, generator=g) * 2)
    qkv[0, (hq + 1) * d:(hq + 1) * d + 4] = torch.tensor([600.0, -900.0, 5e4, 447.0])  # row 0's k head 1
    qkv = qkv.to(device, bf)
    pos = seq.long() - 1
    tab = tables.long().cpu()
    slots = torch.tensor([int(tab[b, p // bs]) * bs + p % bs for b, p in enumerate(pos.tolist())]).to(device)
    f = torch.arange(512, dtype=torch.float32)[:, None] * (1.0 / 10000.0 ** (torch.arange(0, d, 2) / d))[None, :]
    cs = torch.cat([f.cos(), f.sin()], -1).to(device)
    kr, vr = kc.clone(), vc.clone()
    q_ref = reference_qk_norm_rope_cache(qkv, pos, cs, hq, hkv, d, kr, vr, slots, None, None, 1e-6, d)
    ref = reference_paged_decode_attention(q_ref, kr, vr, tables, seq, scale)
    out = fused_decode_attention_triton(qkv, pos, cs, hq, hkv, d, kc, vc, slots, tables, seq, scale,
                                        None, None, 1e-6, d, num_splits=2)
    close(out, ref, bf)
    assert torch.equal(kc.view(torch.uint8), kr.view(torch.uint8)) and torch.equal(vc.view(torch.uint8), vr.view(torch.uint8))
    new_k = kr[int(slots[0]) // bs, int(slots[0]) % bs, 1].float()
    assert new_k.isfinite().all() and new_k.abs().max() == 448


def test_fp8_cache_kernels_compile_for_sm90():
    """Every kernel that writes or reads an fp8 KV cache compiles for sm_90 through its launcher
    (tools/ptxas_check.py ``kv_cache_fp8``), with e4m3 conversions in its PTX. Spills: none, but
    the fused decode kernel's 4 bytes (its prefetched fp8 tile beside the widened one, at the
    128-register cap of its 4 warps; the 16-bit cache's build has none)."""
    from tests.kernels.conftest import sm90_compile
    out = sm90_compile("kv_cache_fp8()")
    rows = dict(ln.split(": ", 1) for ln in out.strip().splitlines())
    assert {name.split("/")[0] for name in rows} == {"paged_decode", "fused_decode", "paged_prefill",
                                                     "qk_norm_rope_cache", "mla_prep", "mla_decode", "sparse_mla"}
    for name, report in rows.items():
        converts, ptxas = report.split(" ", 1)
        assert "registers" in ptxas, (name, report)
        assert int(converts) > 0 or "combine" in name, (name, report)   # (the combines read fp32 partials)
        spill = int(ptxas.split(" bytes spill stores")[0].rsplit(" ", 1)[-1])
        assert spill <= (8 if name.startswith("fused_decode") else 0), (name, report)
