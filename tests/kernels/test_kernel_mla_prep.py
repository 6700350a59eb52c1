import pytest
import torch

pytest.importorskip("triton")

from blitzllm.kernels.attention.mla_prep import mla_prep_triton, reference_mla_prep  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rope_cache(max_pos, rot, base=10000.0, mscale=1.0):
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    f = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([f.cos() * mscale, f.sin() * mscale], dim=-1)


CASES = [  # T, H, N (nope), R (latent), P (rope), interleave, dtype
    (1, 1, 16, 32, 16, True, torch.float32),
    (5, 3, 16, 48, 16, True, torch.float32),    # odd head count, R not a power of two
    (4, 20, 8, 32, 8, False, torch.float32),    # two head blocks, rotate-half layout
    (6, 4, 32, 64, 32, True, torch.bfloat16),
]


@pytest.mark.parametrize("case", CASES)
def test_mla_prep_matches_reference(case, device):
    T, H, N, R, P, interleave, dtype = case
    g = torch.Generator().manual_seed(T * 31 + H)
    q_all = torch.randn(T, H, N + P + 3, generator=g)[..., :N + P].to(device, dtype)   # strided heads
    qkv_a = torch.randn(T, 7 + R + P, generator=g).to(device, dtype)
    kv_a = qkv_a[:, 7:]                                                                 # strided rows
    pos = torch.randint(0, 200, (T,), generator=g).to(device)
    cs = rope_cache(256, P, mscale=1.3).to(device)
    w = (1 + 0.3 * torch.randn(R, generator=g)).to(device, dtype)
    nb, bs = 4, 16
    slots = torch.randperm(nb * bs, generator=g)[:T]
    if T > 2:
        slots[1] = -1
    slots = slots.to(device)
    cache = torch.randn(nb, bs, 1, R + P, generator=g).to(device, dtype)
    ref_cache = cache.clone()
    ref = reference_mla_prep(q_all, kv_a, pos, cs, w, 1e-6, ref_cache, slots, N, interleave)
    out = mla_prep_triton(q_all, kv_a, pos, cs, w, 1e-6, cache, slots, N, interleave)
    assert out.shape == (T, H, P) and out.is_contiguous()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(cache.float(), ref_cache.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_reference_is_the_layer_math():
    """reference_mla_prep reproduces MLAttention's torch steps (norm, interleaved rope,
    cache write) on a tiny layer."""
    from blitzllm.layers.attention import AttentionMetadata, ForwardContext, TorchAttentionBackend, forward_context
    from blitzllm.layers.mla import MLADims, MLAttention
    from blitzllm.layers.rotary import RotaryEmbedding
    torch.manual_seed(0)
    d = MLADims(hidden=32, num_heads=3, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=8, v_head_dim=8)
    layer = MLAttention(d, 0, RotaryEmbedding(8, 64, 10000.0), scale=0.3)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
        layer.kv_a_layernorm.weight.normal_(1.0, 0.3)
    T = 5
    x = torch.randn(T, 32)
    pos = torch.arange(T)
    slots = torch.tensor([3, 9, 1, 30, 17])
    cache = torch.zeros(2, 16, 1, 24)
    md = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.tensor([0, T], dtype=torch.int32),
                           seq_lens=torch.tensor([T], dtype=torch.int32), block_tables=torch.tensor([[0, 1]]),
                           max_q_len=T, max_seq_len=T, q_lens_host=[T], seq_lens_host=[T])
    with torch.no_grad(), forward_context(ForwardContext(md, [(cache, None)], TorchAttentionBackend())):
        qkv_a = layer.fused_qkv_a_proj(x)
        layer.attend(pos, qkv_a)
        q = qkv_a[:, :3 * 16].reshape(T, 3, 16)
        ref_cache = torch.zeros_like(cache)
        reference_mla_prep(q, qkv_a[:, 48:], pos, layer.rotary.cos_sin_cache, layer.kv_a_layernorm.weight,
                           1e-6, ref_cache, slots, 8, True)
    torch.testing.assert_close(ref_cache, cache, atol=1e-5, rtol=1e-5)


def test_layer_with_fused_prep_matches_torch_steps(monkeypatch, device):
    """MLAttention with the fused prologue (the CUDA path; without a GPU, taken for CPU tensors with
    the kernel under the interpreter) gives the same output and latent cache as its torch steps, for
    a prefill chunk and a decode step."""
    from blitzllm.layers import mla
    from blitzllm.layers.attention import AttentionMetadata, ForwardContext, TorchAttentionBackend, forward_context
    from blitzllm.layers.rotary import RotaryEmbedding
    torch.manual_seed(1)
    d = mla.MLADims(hidden=32, num_heads=3, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                    qk_rope_head_dim=8, v_head_dim=8)
    layer = mla.MLAttention(d, 0, RotaryEmbedding(8, 64, 10000.0), scale=0.3)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    layer = layer.to(device)
    tables = torch.tensor([[1, 0]], dtype=torch.int32, device=device)

    def run(fused):
        monkeypatch.setattr(mla, "use_triton", lambda t: fused)
        cache = torch.zeros(2, 16, 1, 24, device=device)
        outs = []
        for start, end in ((0, 19), (19, 20)):   # a prefill chunk crossing a block, then one decode
            n = end - start
            pos = torch.arange(start, end, device=device)
            md = AttentionMetadata(slot_mapping=tables[0, pos // 16].long() * 16 + pos % 16,
                                   query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
                                   seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
                                   block_tables=tables, max_q_len=n, max_seq_len=end, q_lens_host=[n],
                                   seq_lens_host=[end])
            x = torch.randn(n, 32, generator=torch.Generator().manual_seed(end)).to(device)
            with torch.no_grad(), forward_context(ForwardContext(md, [(cache, None)], TorchAttentionBackend())):
                outs.append(layer(pos, x))
        return outs, cache

    (a, ca), (b, cb) = run(False), run(True)
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cb, ca, atol=1e-5, rtol=1e-5)


def test_mla_prep_fp8_cache_bytes(device):
    """kv_cache_dtype="fp8": the fused prep writes the bytes of the torch steps (the latent and the
    rotated rope part rounded to bf16, then to e4m3), a latent past +-448 clamped."""
    T, H, N, R, P = 6, 4, 32, 64, 32
    g = torch.Generator().manual_seed(9)
    q_all = torch.randn(T, H, N + P, generator=g).to(device, torch.bfloat16)
    kv = torch.randn(T, R + P, generator=g) * 3
    kv[2, R:R + 4] = torch.tensor([700.0, -2000.0, 5.0, 1.0])    # rope values past the fp8 range
    kv_a = kv.to(device, torch.bfloat16)
    pos = torch.randint(0, 200, (T,), generator=g).to(device)
    cs = rope_cache(256, P).to(device)
    w = (1 + 0.3 * torch.randn(R, generator=g)).to(device, torch.bfloat16)
    slots = torch.randperm(64, generator=g)[:T].to(device)
    cache = torch.zeros(4, 16, 1, R + P, dtype=torch.float8_e4m3fn, device=device)
    ref_cache = cache.clone()
    reference_mla_prep(q_all, kv_a, pos, cs, w, 1e-6, ref_cache, slots, N, True)
    mla_prep_triton(q_all, kv_a, pos, cs, w, 1e-6, cache, slots, N, True)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    assert cache.float().abs().max() == 448 and cache.float().isfinite().all()
