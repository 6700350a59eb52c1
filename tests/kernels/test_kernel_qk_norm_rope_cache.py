import pytest
import torch

pytest.importorskip("triton")

from blitzllm.kernels.attention.qk_norm_rope_cache import (  # noqa: E402
    fused_qk_norm_rope_cache, fused_qk_norm_rope_cache_triton, reference_qk_norm_rope_cache)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def rope_cache(max_pos, rot, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    f = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.sin()], dim=-1)


def make_case(T, hq, hkv, d, rot, bs, dtype, norm, device="cpu", num_blocks=6):
    qkv = (torch.randn(T, (hq + 2 * hkv) * d) * 2).to(device, dtype)
    pos = torch.randint(0, 500, (T,)).to(device)
    cs = rope_cache(512, rot).to(device)
    slots = torch.randperm(num_blocks * bs)[:T]
    if T > 2:
        slots[1] = -1  # not written
        slots[T - 1] = -7
    kc = torch.randn(num_blocks, bs, hkv, d).to(device, dtype)
    vc = torch.randn(num_blocks, bs, hkv, d).to(device, dtype)
    qw = kw = None
    if norm:  # True / "head": per-head weights of d; "full": over all heads (MiniMax-M2)
        full = norm == "full"
        qw = (1 + 0.3 * torch.randn(hq * d if full else d)).to(device, dtype)
        kw = (1 + 0.3 * torch.randn(hkv * d if full else d)).to(device, dtype)
    return qkv, pos, cs, kc, vc, slots.to(device), qw, kw


CASES = [  # T, Hq, Hkv, D, rotary_dim, block_size, norm
    (1, 4, 4, 64, 64, 16, False),
    (7, 6, 2, 64, 64, 16, True),
    (7, 6, 2, 64, 32, 32, True),   # partial rotary + GQA 3
    (5, 3, 1, 128, 128, 16, True),
    (33, 4, 4, 128, 64, 16, False),
    (7, 6, 2, 64, 32, 16, "full"),  # full-width q/k norm + partial rotary (MiniMax-M2)
    (3, 5, 1, 32, 32, 16, "full"),  # odd head count: padded rows stay out of the norm
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_fused_qk_norm_rope_cache(case, dtype, device):
    T, hq, hkv, d, rot, bs, norm = case
    qkv, pos, cs, kc, vc, slots, qw, kw = make_case(T, hq, hkv, d, rot, bs, dtype, norm, device)
    kc2, vc2 = kc.clone(), vc.clone()
    full = norm == "full"
    q = fused_qk_norm_rope_cache_triton(qkv, pos, cs, hq, hkv, d, kc, vc, slots, qw, kw,
                                        1e-6, rot, full)
    q_ref = reference_qk_norm_rope_cache(qkv, pos, cs, hq, hkv, d, kc2, vc2, slots, qw, kw,
                                         1e-6, rot, full)
    assert q.shape == (T, hq, d) and q.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(q.float(), q_ref.float(), atol=tol * 4, rtol=tol)
    torch.testing.assert_close(kc.float(), kc2.float(), atol=tol * 4, rtol=tol)
    assert torch.equal(vc, vc2)  # raw copy, negative slots untouched


def test_reference_matches_hf_formula():
    """The reference is HF's rotate_half rope (cos/sin in fp32) + Qwen3 head norm."""
    T, hq, hkv, d, rot = 5, 4, 2, 64, 64
    qkv, pos, cs, kc, vc, slots, qw, kw = make_case(T, hq, hkv, d, rot, 16, torch.float32, True)
    q = reference_qk_norm_rope_cache(qkv, pos, cs, hq, hkv, d, kc, vc, slots, qw, kw, 1e-6)
    x = qkv.view(T, -1, d)[:, :hq]
    x = qw * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    cos = torch.cat([cs[pos, : rot // 2]] * 2, -1)[:, None]
    sin = torch.cat([cs[pos, rot // 2:]] * 2, -1)[:, None]
    rot_half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    torch.testing.assert_close(q, x * cos + rot_half * sin, atol=1e-5, rtol=1e-5)


def test_reference_full_width_matches_hf_formula():
    """Full-width mode is MiniMax-M2's attention: RMSNorm over the whole q (Hq*D) and k
    (Hkv*D) projection outputs, then split into heads, then partial rotary."""
    T, hq, hkv, d, rot = 4, 4, 2, 32, 16
    qkv, pos, cs, kc, vc, slots, qw, kw = make_case(T, hq, hkv, d, rot, 16, torch.float32, "full")
    q = reference_qk_norm_rope_cache(qkv, pos, cs, hq, hkv, d, kc, vc, slots, qw, kw, 1e-6, rot, True)
    x = qkv[:, :hq * d]
    x = (qw * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))).view(T, hq, d)
    cos = torch.cat([cs[pos, : rot // 2]] * 2, -1)[:, None]
    sin = torch.cat([cs[pos, rot // 2:]] * 2, -1)[:, None]
    xr = x[..., :rot]
    rot_half = torch.cat([-xr[..., rot // 2:], xr[..., : rot // 2]], -1)
    want = torch.cat([xr * cos + rot_half * sin, x[..., rot:]], -1)
    torch.testing.assert_close(q, want, atol=1e-5, rtol=1e-5)


def test_strided_qkv_view(device):
    T, hq, hkv, d = 3, 2, 1, 64
    qkv, pos, cs, kc, vc, slots, _, _ = make_case(T, hq, hkv, d, d, 16, torch.float32, False,
                                                  device)
    big = torch.cat([qkv, torch.randn(T, 64, device=device)], dim=1)
    view = big[:, : qkv.shape[1]]
    kc2, vc2 = kc.clone(), vc.clone()
    q = fused_qk_norm_rope_cache_triton(view, pos, cs, hq, hkv, d, kc, vc, slots)
    q_ref = reference_qk_norm_rope_cache(qkv, pos, cs, hq, hkv, d, kc2, vc2, slots)
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(kc, kc2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("norm", [False, True])
def test_gpu_qk_norm_rope_cache_bf16(norm):
    T, hq, hkv, d, bs = 1000, 32, 8, 128, 16
    case = make_case(T, hq, hkv, d, d, bs, torch.bfloat16, norm, device="cuda", num_blocks=100)
    qkv, pos, cs, kc, vc, slots, qw, kw = case
    kc2, vc2 = kc.clone(), vc.clone()
    q = fused_qk_norm_rope_cache(qkv, pos, cs, hq, hkv, d, kc, vc, slots, qw, kw)
    q_ref = reference_qk_norm_rope_cache(qkv, pos, cs, hq, hkv, d, kc2, vc2, slots, qw, kw)
    torch.testing.assert_close(q.float(), q_ref.float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(kc.float(), kc2.float(), atol=2e-2, rtol=1e-2)
    assert torch.equal(vc, vc2)


@pytest.mark.parametrize("full_width", [False, True])
def test_triton_backend_matches_torch_backend(full_width, device):
    """The attention backends agree on a layer with q/k norms (per head, or MiniMax-M2's
    full width) and partial rotary: a prefill of two sequences, then one decode step."""
    from blitzllm.layers.attention import (Attention, AttentionMetadata, ForwardContext, TorchAttentionBackend,
                                           TritonAttentionBackend, forward_context)
    from blitzllm.layers.norm import RMSNorm
    from blitzllm.layers.rotary import RotaryEmbedding
    hq, hkv, d, rot, bs = 4, 2, 32, 16, 16
    qn = RMSNorm(hq * d if full_width else d)
    kn = RMSNorm(hkv * d if full_width else d)
    with torch.no_grad():
        qn.weight.normal_(1.0, 0.3)
        kn.weight.normal_(1.0, 0.3)
    layer = Attention(hq, hkv, d, 0, RotaryEmbedding(rot, 256, 10000.0), qn.to(device), kn.to(device),
                      full_width_qk_norm=full_width).to(device)
    tables = torch.tensor([[3, 1, 0], [2, 5, 4]], dtype=torch.int32, device=device)

    def step(backend, caches, starts, ends):
        pos = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)]).to(device)
        slots = torch.stack([tables[b, p // bs].long() * bs + p % bs
                             for b, (s, e) in enumerate(zip(starts, ends)) for p in range(s, e)])
        q_lens = [e - s for s, e in zip(starts, ends)]
        md = AttentionMetadata(
            slot_mapping=slots, query_start_loc=torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32,
                                                             device=device),
            seq_lens=torch.tensor(ends, dtype=torch.int32, device=device), block_tables=tables,
            max_q_len=max(q_lens), max_seq_len=max(ends), q_lens_host=q_lens, seq_lens_host=list(ends))
        qkv = torch.randn(len(pos), (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(len(pos))).to(device)
        with forward_context(ForwardContext(md, [caches], backend)):
            return layer(pos, qkv)

    outs = {}
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        caches = tuple(torch.zeros(6, bs, hkv, d, device=device) for _ in range(2))
        prefill = step(backend, caches, [0, 0], [19, 7])
        decode = step(backend, caches, [19, 7], [20, 8])
        outs[backend.name] = (prefill, decode, *caches)
    for want, got in zip(outs["torch"], outs["triton"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
