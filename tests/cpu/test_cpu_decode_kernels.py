"""kernels/cpu_decode (C): each launcher against its torch reference in ops.py on random data:
the residual add + RMSNorm, and the attention block (q / k RMSNorm, rotary, the cache write,
attention over scattered cache rows) with GQA and MHA, batches of rows of different lengths."""
import pytest
import torch

from blitzllm.kernels import cpu_decode as cd


def test_add_rms_norm_matches_reference():
    assert cd.available()
    g = torch.Generator().manual_seed(0)
    for B, H in ((1, 576), (5, 64), (2, 4096)):
        x, res, w = torch.randn(B, H, generator=g), torch.randn(B, H, generator=g), torch.rand(H, generator=g)
        r1, r2 = res.clone(), res.clone()
        got, want = cd.add_rms_norm(x, r1, w, 1e-5), cd.reference_add_rms_norm(x, r2, w, 1e-5)
        assert torch.equal(r1, r2) and torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qk_norm", [False, True])
# (the attention core's forms: one head per task, or a kv head's 2 / 3 query heads sharing each
# widened key (8 x 9 / 3 at 64, 3 x 8 / 2 at 32, on 2 threads); a tail of lanes (40); a head size
# without a register form (96, two heads a task); the softmax's 16-key tail at every length)
@pytest.mark.parametrize("B,hq,hkv,d,bs", [(1, 9, 3, 64, 16), (3, 8, 2, 32, 4), (4, 4, 4, 128, 8), (8, 9, 3, 64, 16),
                                          (2, 4, 2, 40, 8), (6, 8, 2, 96, 8)])
def test_decode_attention_matches_reference(qk_norm, B, hq, hkv, d, bs):
    g = torch.Generator().manual_seed(B * hq + d)
    nblk = 12
    kc, vc = torch.randn(nblk, bs, hkv, d, generator=g), torch.randn(nblk, bs, hkv, d, generator=g)
    lens = torch.tensor([1 + 9 * i for i in range(B)])
    L = int(lens.max())
    gidx = torch.stack([torch.randperm(nblk * bs, generator=g)[:L] for _ in range(B)])  # scattered rows
    slots = torch.stack([gidx[b, lens[b] - 1] for b in range(B)])  # (each row's own new entry)
    qkv = torch.randn(B, (hq + 2 * hkv) * d, generator=g)
    ang = torch.rand(B, d // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([-ang.sin(), ang.sin()], -1)
    qn, kn = (torch.rand(d, generator=g), torch.rand(d, generator=g)) if qk_norm else (None, None)
    args = (qn, kn, 1e-6, cos, sin)
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    q1, q2 = qkv.clone(), qkv.clone()
    got = cd.decode_attention(q1, *args, k1, v1, slots, gidx, lens, hq, hkv, d, d ** -0.5)
    want = cd.reference_decode_attention(q2, *args, k2, v2, slots, gidx, lens, hq, hkv, d, d ** -0.5)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    assert torch.allclose(k1, k2, atol=1e-6) and torch.equal(v1, v2)   # the cache writes
    assert torch.allclose(q1, q2, atol=1e-6)                           # q, k normed and rotated in place


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 steps between two bf16 tensors of one sign pattern."""
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ai - bi).abs().max())


def test_bf16_glue_matches_the_models_roundings():
    """The bf16 forms (the glue around torch's bf16 GEMMs under --dtype bfloat16): the residual
    add rounds as torch's bf16 add (exactly), the norm's output is at most one bf16 step from
    kernels/norm's reference roundings."""
    g = torch.Generator().manual_seed(1)
    for B, H in ((1, 576), (5, 64), (2, 4096), (3, 100), (70, 48)):  # (a tail past 16 lanes; rows in parallel)
        x, res = torch.randn(B, H, generator=g).bfloat16(), torch.randn(B, H, generator=g).bfloat16()
        w = torch.rand(H, generator=g).bfloat16()
        r1, r2 = res.clone(), res.clone()
        got, want = cd.add_rms_norm(x, r1, w, 1e-5), cd.reference_add_rms_norm(x, r2, w, 1e-5)
        assert got.dtype == torch.bfloat16 and torch.equal(r1, r2) and torch.equal(r1, x + res)
        assert _ulps(got, want) <= 1 and (got != want).float().mean() < 0.01
        r3, new = res.clone(), torch.empty_like(res)  # out of place: res kept, the sum in new
        assert torch.equal(cd.add_rms_norm(x, r3, w, 1e-5, res_out=new), got)
        assert torch.equal(r3, res) and torch.equal(new, r1)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("B,hq,hkv,d,bs", [(1, 9, 3, 64, 16), (3, 8, 2, 32, 4), (8, 9, 3, 64, 16), (6, 8, 2, 96, 8)])
def test_bf16_decode_attention_matches_reference(qk_norm, B, hq, hkv, d, bs):
    """bf16 qkv, caches and output (fp32 inside): the cache writes (k normed, rotated and rounded
    as the reference does; v as given) and the attention output against the reference's bf16
    ops (torch's bf16 SDPA rounds its probabilities; ours stay fp32: a few bf16 steps)."""
    g = torch.Generator().manual_seed(B * hq + d + 1)
    nblk = 12
    kc = torch.randn(nblk, bs, hkv, d, generator=g).bfloat16()
    vc = torch.randn(nblk, bs, hkv, d, generator=g).bfloat16()
    lens = torch.tensor([1 + 9 * i for i in range(B)])
    L = int(lens.max())
    gidx = torch.stack([torch.randperm(nblk * bs, generator=g)[:L] for _ in range(B)])
    slots = torch.stack([gidx[b, lens[b] - 1] for b in range(B)])
    qkv = torch.randn(B, (hq + 2 * hkv) * d, generator=g).bfloat16()
    ang = torch.rand(B, d // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([-ang.sin(), ang.sin()], -1)
    qn, kn = (torch.rand(d, generator=g).bfloat16(), torch.rand(d, generator=g).bfloat16()) if qk_norm else (None, None)
    args = (qn, kn, 1e-6, cos, sin)
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    got = cd.decode_attention(qkv.clone(), *args, k1, v1, slots, gidx, lens, hq, hkv, d, d ** -0.5)
    want = cd.reference_decode_attention(qkv.clone(), *args, k2, v2, slots, gidx, lens, hq, hkv, d, d ** -0.5)
    assert got.dtype == torch.bfloat16 and torch.equal(v1, v2) and _ulps(k1, k2) <= 1
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    # and within fp32 rounding of the same math on the written caches (our probabilities are fp32)
    f32 = cd.reference_decode_attention(qkv.float(), *(t.float() if t is not None else None for t in (qn, kn)),
                                        1e-6, cos, sin, k2.float(), v2.float(), slots, gidx, lens, hq, hkv, d,
                                        d ** -0.5)
    torch.testing.assert_close(got.float(), f32, atol=8e-3, rtol=8e-3)


def test_greedy_matches_torch_argmax_and_log_softmax():
    """kernels/cpu_decode's greedy against kernels/greedy's torch reference: the same tokens
    (ties to the first maximum, as torch.argmax), log-softmax within fp32 rounding; a row with a
    NaN goes back to the reference (None)."""
    from blitzllm.kernels.greedy import greedy_sample, reference_greedy_sample
    g = torch.Generator().manual_seed(3)
    for B, V in ((1, 49152), (3, 1000), (5, 17), (2, 16)):  # (tails of 8, 1 and 0 lanes)
        x = torch.randn(B, V, generator=g) * 4
        x[0, V // 3] = x[0, V - 1] = x.max() + 1  # a tie: the first one wins
        tok, lp = cd.greedy(x)
        rt, rl = reference_greedy_sample(x)
        assert torch.equal(tok, rt) and tok[0] == V // 3
        torch.testing.assert_close(lp, rl, atol=2e-6, rtol=1e-5)
    bf = torch.randn(2, 300, generator=g).bfloat16()  # bf16 logits: widened first
    assert torch.equal(cd.greedy(bf)[0], reference_greedy_sample(bf)[0])
    x = torch.randn(2, 100, generator=g)
    x[1, 7] = float("nan")
    assert cd.greedy(x) is None
    assert torch.equal(greedy_sample(x)[0], reference_greedy_sample(x)[0])  # the dispatcher falls back


def test_to_e4m3_rounds_as_the_fp8_cache_rule():
    """The C forms' fp32 -> e4m3 (fp8 KV caches) against kv_store.to_cache (clamp to +-448, torch's
    round to nearest even), byte for byte: every e4m3 value, the midpoints between neighbours (the
    ties, to even), points just off them, subnormals, zeros of both signs, values past 448."""
    from blitzllm.kernels.attention.kv_store import to_cache
    assert cd.available()
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    finite = vals[vals.isfinite()].unique()                       # (0x7f / 0xff are NaN)
    mids = (finite[1:] + finite[:-1]) / 2
    x = torch.cat([finite, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20), -mids,
                   torch.tensor([0.0, -0.0, 448.0, 449.0, 464.0, 480.0, 1e6, -1e30, 2.0 ** -10, 2.0 ** -12, 3e-3])])
    got, want = cd.to_e4m3(x), to_cache(x, torch.float8_e4m3fn)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), x[got.view(torch.uint8) != want.view(torch.uint8)]


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("B,hq,hkv,d,bs", [(1, 9, 3, 64, 16), (3, 8, 2, 32, 4), (6, 8, 2, 96, 8)])
def test_decode_attention_over_an_fp8_cache(bf16, B, hq, hkv, d, bs):
    """An fp8 (e4m3) cache under fp32 or bf16 activations (kv_cache_dtype="fp8"): the new k / v are
    written byte for byte as the reference writes them (k rounded to the activations' dtype first),
    the entries widened exactly, so the output is the reference's over the same caches: to fp32
    rounding, or under bf16 within test_bf16_decode_attention_matches_reference's bound (torch's bf16
    SDPA rounds its probabilities)."""
    assert cd.available()
    dt = torch.bfloat16 if bf16 else torch.float32
    g = torch.Generator().manual_seed(B * hq + d + 7)
    nblk = 12
    kc = (torch.randn(nblk, bs, hkv, d, generator=g) * 3).to(torch.float8_e4m3fn)
    vc = (torch.randn(nblk, bs, hkv, d, generator=g) * 3).to(torch.float8_e4m3fn)
    lens = torch.tensor([1 + 9 * i for i in range(B)])
    L = int(lens.max())
    gidx = torch.stack([torch.randperm(nblk * bs, generator=g)[:L] for _ in range(B)])
    slots = torch.stack([gidx[b, lens[b] - 1] for b in range(B)])
    qkv = torch.randn(B, (hq + 2 * hkv) * d, generator=g).to(dt)
    qkv[0, (hq + 2 * hkv - 1) * d] = 1000.0                  # a value past the fp8 range: clamped
    ang = torch.rand(B, d // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([-ang.sin(), ang.sin()], -1)
    args = (None, None, 1e-6, cos, sin)
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    got = cd.decode_attention(qkv.clone(), *args, k1, v1, slots, gidx, lens, hq, hkv, d, d ** -0.5)
    want = cd.reference_decode_attention(qkv.clone(), *args, k2, v2, slots, gidx, lens, hq, hkv, d, d ** -0.5)
    assert torch.equal(k1.view(torch.uint8), k2.view(torch.uint8)) and torch.equal(v1.view(torch.uint8), v2.view(torch.uint8))
    assert v1.float().abs().max() == 448
    tol = 2e-2 if bf16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
