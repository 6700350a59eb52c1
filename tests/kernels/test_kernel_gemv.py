import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")


from blitzllm.kernels import gemv as gv  # noqa: E402
from blitzllm.kernels.activation import reference_silu_and_mul  # noqa: E402
from blitzllm.kernels.gemv import gemv_config, norm_linear, prefer_gemv, gemv_triton, linear, reference_linear  # noqa: E402

# relative to max |ref|; bf16: the interpreter rounds fp32 -> bf16 toward zero
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
CONFIGS = {  # BLOCK_K 32 with K 33 / 260 leaves ragged chunks; 260 / SPLIT 2 -> fully masked tail
    "n": {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1, "DOT": False},
    "n-dot": {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1, "DOT": True},
    "k": {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2, "DOT": False},
    "k-dot": {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 3, "DOT": True},
    "auto": None,
}
# the swapped tensor-core form (W the wide MMA operand): plain inputs only
SWAP_CONFIGS = {
    "swap-n": {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1, "SWAP": True},
    "swap-k": {"BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 3, "SWAP": True, "num_stages": 3},
}


def close(out, ref, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol,
                               atol=tol * ref.float().abs().max().item())


def make(m, n, k, dtype, device, silu=False, bias=True):
    x = torch.randn(m, 2 * k if silu else k).to(device, dtype)
    w = (torch.randn(n, k) / k ** 0.5).to(device, dtype)
    b = torch.randn(n).to(device, dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("cfg", list(CONFIGS) + list(SWAP_CONFIGS))
@pytest.mark.parametrize("k", [16, 33, 96, 260])
@pytest.mark.parametrize("n", [1, 7, 64, 130])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gemv_fp32(m, n, k, cfg, device):
    """Odd N and K (ragged tiles, fully masked split tails), bias or not; the FMA, tensor-core
    and swapped tensor-core forms."""
    x, w, b = make(m, n, k, torch.float32, device, bias=(m + n) % 2 == 1)
    out = gemv_triton(x, w, b, config={**CONFIGS, **SWAP_CONFIGS}[cfg])
    assert out.shape == (m, n) and out.dtype == torch.float32
    close(out, reference_linear(x, w, b), torch.float32)


@pytest.mark.parametrize("cfg", list(SWAP_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_swap_half(dtype, cfg, device):
    x, w, b = make(2, 130, 96, dtype, device)
    for _ in range(2):  # split-K: the second call starts from the zeros the first one left
        out = gemv_triton(x, w, b, config=SWAP_CONFIGS[cfg])
        assert out.dtype == dtype
        close(out, reference_linear(x, w, b), dtype)


def test_gemv_swap_refuses_fused_inputs(device):
    x, w, _ = make(1, 40, 32, torch.float32, device, silu=True)
    with pytest.raises(AssertionError, match="plain input"):
        gemv_triton(x, w, silu_mul_input=True, config=SWAP_CONFIGS["swap-n"])


GLU_CONFIGS = {"n": {"BLOCK_N": 16, "BLOCK_K": 32, "DOT": False}, "n-dot": {"BLOCK_N": 32, "BLOCK_K": 32, "DOT": True},
               "narrow": {"BLOCK_N": 2, "BLOCK_K": 64, "DOT": False}, "auto": None}


@pytest.mark.parametrize("cfg", list(GLU_CONFIGS))
@pytest.mark.parametrize("m,inter,k", [(1, 7, 33), (1, 65, 260), (3, 40, 96), (16, 9, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_glu(dtype, m, inter, k, cfg, device):
    """silu_and_mul(x @ w^T + b) from the packed gate_up in one launch: ragged gate / up
    halves (the tile's up rows sit `inter` rows further on), bias or not."""
    x, w, b = make(m, 2 * inter, k, dtype, device, bias=inter % 2 == 1)
    out = gv.gemv_glu_triton(x, w, b, config=GLU_CONFIGS[cfg])
    assert out.shape == (m, inter) and out.dtype == dtype
    want = reference_silu_and_mul(reference_linear(x, w, b))
    close(out, want, dtype)
    if dtype == torch.float32:  # the same as the unfused GEMV then silu_and_mul
        close(out, reference_silu_and_mul(gemv_triton(x, w, b)), dtype)


@pytest.mark.parametrize("cfg", ["n", "n-dot"])
@pytest.mark.parametrize("dtype,m", [(torch.float32, 1), (torch.bfloat16, 2)])
def test_gemv_glu_norm_prologue_from_sum_squares(dtype, m, cfg, device):
    """The norm chain's gate_up: GLU of rms_norm(s), the rows' sums of squares read from the
    slot; the launch and ss_norm_glu's torch fallback agree with the unfused ops."""
    from blitzllm.kernels.rmsnorm import reference_rms_norm
    s, w, b = make(m, 2 * 40, 96, dtype, device)
    nw = (1 + 0.1 * torch.randn(96)).to(device, dtype)
    ss = torch.zeros(gv.SS_LANES, gv.SS_STRIDE, device=device)
    ss[:, :m] = s.float().pow(2).sum(-1) / gv.SS_LANES  # spread over the lanes
    ss = ss.view(-1)
    want = reference_silu_and_mul(reference_linear(reference_rms_norm(s, nw, 1e-5), w, b))
    close(gv.gemv_glu_triton(s, w, b, norm_weight=nw, ss=ss, eps=1e-5, config=GLU_CONFIGS[cfg]), want, dtype)
    close(gv.ss_norm_glu(s, ss, w, b, nw, 1e-5), want, dtype)  # CPU: the torch ops
    with pytest.raises(AssertionError, match="together"):
        gv.gemv_glu_triton(s, w, norm_weight=nw)


def test_gemv_glu_checks(device):
    x, w, _ = make(1, 7, 32, torch.float32, device)
    with pytest.raises(AssertionError, match=r"\[2I, K\]"):
        gv.gemv_glu_triton(x, w)  # odd row count: no gate / up halves
    with pytest.raises(AssertionError, match="BLOCK_N >= 2"):
        gv.gemv_glu_triton(x, torch.randn(8, 32, device=device), config={"BLOCK_N": 1})
    assert gv.gemv_glu_triton(x[:0], torch.randn(8, 32, device=device)).shape == (0, 4)


@pytest.mark.parametrize("cfg", ["n", "k", "k-dot"])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_half(dtype, silu, cfg, device):
    m, n, k = (3, 64, 260) if cfg == "k" else (16, 130, 96)
    x, w, b = make(m, n, k, dtype, device, silu=silu, bias=silu)
    out = gemv_triton(x, w, b, silu_mul_input=silu, config=CONFIGS[cfg])
    assert out.dtype == dtype
    close(out, reference_linear(x, w, b, silu_mul_input=silu), dtype)


@pytest.mark.parametrize("silu", [False, True])
def test_fp32_silu_matches_unfused(silu, device):
    x, w, b = make(3, 7, 33, torch.float32, device, silu=silu)
    out = gemv_triton(x, w, b, silu_mul_input=silu, config=CONFIGS["k"])
    xin = reference_silu_and_mul(x) if silu else x
    close(out, F.linear(xin, w, b), torch.float32)


@pytest.mark.parametrize("silu", [False, True])
def test_row_views_and_out(silu, device):
    m, n, k = 3, 40, 96
    width = 2 * k if silu else k
    big = torch.randn(m, width + 24, device=device)
    x = big[:, 8:8 + width]  # rows with stride width + 24
    w = torch.randn(n, k, device=device)
    buf = torch.full((m, n + 5), 7.0, device=device)
    out = buf[:, :n]
    res = gemv_triton(x, w, silu_mul_input=silu, out=out, config=CONFIGS["k"])
    assert res.data_ptr() == out.data_ptr()
    close(out, reference_linear(x, w, silu_mul_input=silu), torch.float32)
    assert (buf[:, n:] == 7.0).all()


@pytest.mark.parametrize("cfg", ["k", "k-dot"])
def test_split_k_workspace_resets(cfg, device):
    x, w, b = make(16, 64, 260, torch.float32, device)
    ref = reference_linear(x, w, b)
    for _ in range(2):  # the second call starts from the zeros the first one left
        close(gemv_triton(x, w, b, config=CONFIGS[cfg]), ref, torch.float32)
    x2, w2, _ = make(9, 64, 96, torch.float32, device)  # shares the same cached buffers
    close(gemv_triton(x2, w2, config=CONFIGS[cfg]), reference_linear(x2, w2), torch.float32)
    for buf in (gv._zeros(x.device, torch.float32, 1024), gv._zeros(x.device, torch.int32, 4)):
        assert not buf.any()


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("resid", [False, True])
@pytest.mark.parametrize("dtype,m,k", [(torch.float32, 1, 33), (torch.float32, 3, 260),
                                       (torch.bfloat16, 16, 96)])
def test_norm_prologue(dtype, m, k, resid, cfg, device):
    """norm_weight (+ residual): the GEMV of rms_norm(x + residual), and x + residual back."""
    from blitzllm.kernels.rmsnorm import reference_fused_add_rms_norm, reference_rms_norm
    x, w, b = make(m, 40, k, dtype, device)
    nw = (1 + 0.1 * torch.randn(k)).to(device, dtype)
    r = torch.randn(m, k).to(device, dtype) if resid else None
    y, new_res = gemv_triton(x, w, b, norm_weight=nw, residual=r, eps=1e-5, config=CONFIGS[cfg])
    if resid:
        normed, want_res = reference_fused_add_rms_norm(x, r, nw, 1e-5)
        close(new_res, want_res, dtype)  # (the interpreter's bf16 rounds toward zero)
    else:
        normed, want_res = reference_rms_norm(x, nw, 1e-5), x
        assert new_res is x
    close(y, reference_linear(normed, w, b), dtype)
    y2, _ = norm_linear(x, r, w, b, nw, 1e-5)  # CPU dispatch: the unfused torch path
    close(y2, reference_linear(normed, w, b), dtype)


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("dtype,m,n,k", [(torch.float32, 1, 40, 33), (torch.float32, 3, 130, 260),
                                         (torch.bfloat16, 16, 64, 96)])
def test_residual_add_sum_squares_epilogue(dtype, m, n, k, silu, cfg, device):
    """add_residual: linear(x) + residual rounded as the unfused ops, the rows' sums of
    squares added onto ss (rows >= m untouched), the other slot zeroed."""
    x, w, b = make(m, n, k, dtype, device, silu=silu, bias=not silu)
    r = torch.randn(m, n).to(device, dtype)
    slots = torch.rand(2, gv.SS_SLOT, device=device) + 1.0  # dirty: ss keeps, ss_clear loses
    before = gv.slot_sums(slots[0], gv.GEMV_MAX_ROWS)
    s = gemv_triton(x, w, b, silu_mul_input=silu, add_residual=r, ss=slots[0], ss_clear=slots[1],
                    config=CONFIGS[cfg])
    want = (reference_linear(x, w, b, silu_mul_input=silu).float() + r.float()).to(dtype)
    close(s, want, dtype)
    assert s.dtype == dtype and s.shape == (m, n)
    # the kernel's sums are of its own (rounded) s: check them exactly against s
    after = gv.slot_sums(slots[0], gv.GEMV_MAX_ROWS)
    torch.testing.assert_close(after[:m], before[:m] + s.float().pow(2).sum(-1), rtol=1e-5, atol=1e-5)
    assert torch.equal(after[m:], before[m:])
    assert not slots[1].any()


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("dtype,m,k", [(torch.float32, 1, 33), (torch.float32, 3, 260), (torch.bfloat16, 16, 96)])
def test_norm_prologue_from_sum_squares(dtype, m, k, cfg, device):
    """norm_weight with ss: rms_norm(x) with the rows' sums of squares read from ss."""
    from blitzllm.kernels.rmsnorm import reference_rms_norm
    x, w, b = make(m, 40, k, dtype, device)
    nw = (1 + 0.1 * torch.randn(k)).to(device, dtype)
    ss = torch.zeros(gv.SS_LANES, gv.SS_STRIDE, device=device)
    ss[:, :m] = x.float().pow(2).sum(-1) / gv.SS_LANES  # spread over the lanes
    ss = ss.view(-1)
    y, same = gemv_triton(x, w, b, norm_weight=nw, ss=ss, eps=1e-5, config=CONFIGS[cfg])
    assert same is x
    close(y, reference_linear(reference_rms_norm(x, nw, 1e-5), w, b), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_chain_matches_unfused_ops(dtype, device):
    """Two pre-norm sub-blocks as the chain (producer -> consumer -> producer -> consumer,
    the slots alternating) against linear + fused_add_rms_norm; launches and the torch
    fallback (CPU tensors without the interpreter's dispatch) agree."""
    from blitzllm.kernels.rmsnorm import reference_fused_add_rms_norm
    torch.manual_seed(0)
    m, h, inter = 2, 64, 96
    x = torch.randn(m, h).to(device, dtype)
    res = torch.randn(m, h).to(device, dtype)
    wo = (torch.randn(h, h) / h ** 0.5).to(device, dtype)
    wgu = (torch.randn(2 * inter, h) / h ** 0.5).to(device, dtype)
    wd = (torch.randn(h, inter) / inter ** 0.5).to(device, dtype)
    n1, n2 = ((1 + 0.1 * torch.randn(h)).to(device, dtype) for _ in range(2))
    # unfused reference
    r1 = (reference_linear(x, wo).float() + res.float()).to(dtype)
    h1, _ = reference_fused_add_rms_norm(reference_linear(x, wo), res, n1, 1e-6)
    gu = reference_linear(h1, wgu)
    r2 = (reference_linear(gu, wd, silu_mul_input=True).float() + r1.float()).to(dtype)
    h2, _ = reference_fused_add_rms_norm(reference_linear(gu, wd, silu_mul_input=True), r1, n2, 1e-6)
    want = reference_linear(h2, wgu)
    for launch in (True, False):
        slots = torch.zeros(2, gv.SS_SLOT, device=device)
        slots[1] = 5.0  # left dirty by an earlier step: the first producer clears it
        if launch:
            s1 = gemv_triton(x, wo, add_residual=res, ss=slots[0], ss_clear=slots[1], config=CONFIGS["k"])
            g1, _ = gemv_triton(s1, wgu, norm_weight=n1, ss=slots[0], config=CONFIGS["n"])
            s2 = gemv_triton(g1, wd, silu_mul_input=True, add_residual=s1, ss=slots[1], ss_clear=slots[0],
                             config=CONFIGS["k-dot"])
            out, _ = gemv_triton(s2, wgu, norm_weight=n2, ss=slots[1], config=CONFIGS["n-dot"])
        else:
            s1 = gv.linear_add_ss(x, wo, None, res, slots[0], slots[1])
            g1 = gv.ss_norm_linear(s1, slots[0], wgu, None, n1, 1e-6)
            s2 = gv.linear_add_ss(g1, wd, None, s1, slots[1], slots[0], silu_mul_input=True)
            out = gv.ss_norm_linear(s2, slots[1], wgu, None, n2, 1e-6)
        close(s1, r1, dtype)
        close(s2, r2, dtype)
        close(out, want, dtype)
        assert not slots[0].any()  # the second producer cleared the first slot
        torch.testing.assert_close(gv.slot_sums(slots[1], m), s2.float().pow(2).sum(-1), rtol=1e-5, atol=1e-5)


def test_config_heuristic():
    bf16, sms = torch.bfloat16, 132
    for m in (1, 4, 16):
        for n, k in [(6144, 4096), (4096, 14336), (1024, 2048), (151936, 1024)]:
            for silu in (False, True):
                c = gemv_config(m, n, k, bf16, sms, silu_mul_input=silu)
                tiles, chunks = -(-n // c["BLOCK_N"]), -(-k // c["BLOCK_K"])
                # at least a program per SM, 16-byte loads, tensor cores from 3 rows on
                assert tiles * c["SPLIT_K"] >= min(sms, tiles * chunks)
                assert c["BLOCK_K"] >= 128 and c["DOT"] == (m > 2)
                if tiles >= sms:
                    assert c["SPLIT_K"] == 1  # no atomics when the N tiles fill the GPU
                if silu and c["DOT"]:
                    assert c["BLOCK_N"] == 64  # wide N tiles: fewer silu recomputations
    assert gemv_config(4, 1024, 2048, bf16, sms)["SPLIT_K"] > 1  # too few n-tiles alone
    assert gemv_config(1, 1024, 2048, bf16, sms)["BLOCK_N"] == 2  # narrow FMA tiles instead
    # silu-and-mul input: every program evaluates the silu of all of x; the heuristic widens
    # the N tiles until the launch's silu count is within its budget (or the tile is 8+ wide)
    for n, k in [(4096, 14336), (1024, 3072), (2560, 9728), (8192, 28672)]:
        c = gemv_config(1, n, k, bf16, sms, silu_mul_input=True)
        assert -(-n // c["BLOCK_N"]) * k <= gv._SILU_EXP_BUDGET or c["BLOCK_N"] >= 8
        assert c["BLOCK_N"] >= gemv_config(1, n, k, bf16, sms)["BLOCK_N"]
    assert gemv_config(1, 4096, 14336, bf16, sms, silu_mul_input=True)["BLOCK_N"] == 8
    assert gemv_config(1, 1024, 3072, bf16, sms, silu_mul_input=True)["BLOCK_N"] == 2  # small: unchanged
    assert gemv_config(1, 64, 16, torch.float32, 8)["BLOCK_K"] == 16  # not wider than K
    c = gemv_config(1, 4096, 4096, bf16, sms, {"BLOCK_N": 64, "DOT": True})
    assert c["BLOCK_N"] == 64 and c["SPLIT_K"] > 1 and c["DOT"]  # 64 n-tiles: split for the rest
    assert gemv_config(1, 4096, 4096, bf16, sms, {"BLOCK_N": 8})["SPLIT_K"] == 1
    assert gemv_config(1, 4096, 520, bf16, sms, {"BLOCK_N": 64, "SPLIT_K": 3})["SPLIT_K"] == 2
    with pytest.raises(KeyError):
        gemv_config(1, 64, 64, bf16, sms, {"BLOCK_M": 16})


def test_prefer_gemv_policy():
    # cuBLAS keeps the big matrices with several rows, and at 1-2 rows those above 64M
    # weights (32M with the silu-and-mul fused in: Llama-8B's down_proj measured faster as a
    # silu kernel, then the plain GEMV)
    assert prefer_gemv(1, 4096, 1024) and prefer_gemv(16, 1024, 3072, True)
    assert prefer_gemv(1, 1024, 3072, True) and prefer_gemv(2, 4096, 4096)
    assert prefer_gemv(1, 4096, 14336) and not prefer_gemv(1, 4096, 14336, True)
    assert not prefer_gemv(1, 28672, 4096) and not prefer_gemv(1, 128256, 4096)
    assert not prefer_gemv(4, 4096, 14336, True) and not prefer_gemv(16, 6144, 4096)


def test_linear_dispatch_cpu_uses_torch():
    x, w, b = torch.randn(2, 3, 32), torch.randn(24, 32), torch.randn(24)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    g = torch.randn(2, 64)
    assert torch.equal(linear(g, w, silu_mul_input=True), F.linear(reference_silu_and_mul(g), w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_linear_bf16():
    dev, dt = "cuda", torch.bfloat16
    for n, k in [(6144, 4096), (1024, 3072), (4096, 14336)]:
        w = torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5
        b = torch.randn(n, device=dev, dtype=dt)
        for m in (1, 4, 16):
            x = torch.randn(2, m, k, device=dev, dtype=dt)[1]
            close(linear(x, w, b), reference_linear(x, w, b), dt)
            for cfg in (CONFIGS["n"], CONFIGS["k-dot"], {"SWAP": True}, {"SWAP": True, "BLOCK_N": 128}):
                for _ in range(2):  # split-K buffers reset by the first call
                    close(gemv_triton(x, w, b, config=cfg), reference_linear(x, w, b), dt)
            g = torch.randn(m, 2 * k, device=dev, dtype=dt)
            close(linear(g, w, silu_mul_input=True), reference_linear(g, w, silu_mul_input=True), dt)
    from blitzllm.kernels.activation import silu_and_mul
    for n2, k in [(28672, 4096), (6144, 1024)]:  # GLU GEMV: Llama-3.1-8B's and Qwen3-0.6B's gate_up
        w = torch.randn(n2, k, device=dev, dtype=dt) / k ** 0.5
        for m in (1, 2):
            x = torch.randn(m, k, device=dev, dtype=dt)
            glu = gv.gemv_glu_triton(x, w)
            close(glu, reference_silu_and_mul(reference_linear(x, w)), dt)
            # each output: the plain GEMV's gate and up at the same tiles (one K order per row),
            # then the SiLU-and-mul kernel's numerics: bit for bit the two launches
            c = dict(gemv_config(m, n2, k, dt, torch.cuda.get_device_properties(0).multi_processor_count),
                     SPLIT_K=1)
            assert torch.equal(glu, silu_and_mul(gemv_triton(x, w, config=c)))


def test_env_config_reaches_the_launch_and_is_checked(monkeypatch, device):
    """BLITZ_GEMV_CONFIG (A/B runs) sets the launch keys of calls without a config; unknown
    keys fail (at import) with the variable's name."""
    import blitzllm.kernels.gemv as gemv
    monkeypatch.setenv("BLITZ_GEMV_CONFIG", '{"BLOCK_N": 2, "num_warps": 2}')
    assert gemv._env_config() == {"BLOCK_N": 2, "num_warps": 2}
    monkeypatch.setattr(gemv, "_ENV_CONFIG", gemv._env_config())
    seen = {}
    orig = gemv._cached_config

    def spy(M, N, K, dtype, sms, items, silu):
        seen["items"] = dict(items)
        return orig(M, N, K, dtype, sms, items, silu)
    monkeypatch.setattr(gemv, "_cached_config", spy)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 64, generator=g).to(device), torch.randn(40, 64, generator=g).to(device)
    out = gemv.gemv_triton(x, w)
    assert seen["items"] == {"BLOCK_N": 2, "num_warps": 2}
    torch.testing.assert_close(out, reference_linear(x, w), atol=1e-4, rtol=1e-4)
    monkeypatch.setenv("BLITZ_GEMV_CONFIG", '{"BLOCK_Q": 2}')
    with pytest.raises(ValueError, match="BLITZ_GEMV_CONFIG"):
        gemv._env_config()
