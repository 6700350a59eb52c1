import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")


from blitzllm.kernels.gemv import gemv as gv  # noqa: E402
from blitzllm.kernels.activation import reference_silu_and_mul  # noqa: E402
from blitzllm.kernels.gemv.gemv import gemv_config, prefer_gemv, gemv_triton, linear, reference_linear  # noqa: E402

# relative to max |ref|; bf16: the interpreter rounds fp32 -> bf16 toward zero
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
CONFIGS = {  # BLOCK_K 32 with K 33 / 260 leaves ragged chunks; 260 / SPLIT 2 -> fully masked tail
    "n": {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1, "DOT": False},
    "n-dot": {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1, "DOT": True},
    "k": {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2, "DOT": False},
    "k-dot": {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 3, "DOT": True},
    "auto": None,
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


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("k", [16, 33, 96, 260])
@pytest.mark.parametrize("n", [1, 7, 64, 130])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gemv_fp32(m, n, k, cfg, device):
    """Odd N and K (ragged tiles, fully masked split tails), bias or not; the FMA and
    tensor-core forms."""
    x, w, b = make(m, n, k, torch.float32, device, bias=(m + n) % 2 == 1)
    out = gemv_triton(x, w, b, config=CONFIGS[cfg])
    assert out.shape == (m, n) and out.dtype == torch.float32
    close(out, reference_linear(x, w, b), torch.float32)


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
            for cfg in (CONFIGS["n"], CONFIGS["k-dot"]):
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
    keys fail with the variable's name."""
    import blitzllm.kernels.gemv.gemv as gemv
    monkeypatch.setenv("BLITZ_GEMV_CONFIG", '{"BLOCK_N": 2, "num_warps": 2}')
    assert gemv._env_config() == {"BLOCK_N": 2, "num_warps": 2}
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
