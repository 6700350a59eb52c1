import math

import pytest
import torch

pytest.importorskip("triton")

from blitzllm.kernels.moe import router as moe  # noqa: E402
from blitzllm.kernels.moe.experts import (  # noqa: E402
    fused_moe_triton, moe_align_block_size, moe_config)
from blitzllm.kernels.moe.router import (  # noqa: E402
    reference_fused_moe, reference_router_gemm, reference_select_experts, router_config,
    router_gemm_triton, select_experts_triton)

# relative to max |ref|; bf16: the interpreter rounds fp32 -> bf16 toward zero
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def close(out, ref, tol):
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


# ---- router GEMM ----------------------------------------------------------------------

ROUTER_CONFIGS = {  # BLOCK_H 32 with H 33 / 260: ragged chunks; H 260 / SPLIT 3: a short last range
    "fma": {"DOT": False, "BLOCK_E": 4, "BLOCK_H": 64, "SPLIT_H": 1},
    "fma-split": {"DOT": False, "BLOCK_E": 8, "BLOCK_H": 32, "SPLIT_H": 3},
    "dot": {"DOT": True, "BLOCK_E": 16, "BLOCK_H": 32, "SPLIT_H": 1},
    "dot-split": {"DOT": True, "BLOCK_E": 16, "BLOCK_H": 32, "SPLIT_H": 3},
    "auto": None,
}


@pytest.mark.parametrize("cfg", list(ROUTER_CONFIGS))
@pytest.mark.parametrize("t,e,h", [(1, 7, 33), (2, 64, 260), (3, 130, 96), (16, 60, 260), (17, 20, 48)])
def test_router_gemm_fp32(t, e, h, cfg, device):
    x = torch.randn(t, h).to(device)
    w = (torch.randn(e, h) / h ** 0.5).to(device)
    out = router_gemm_triton(x, w, config=ROUTER_CONFIGS[cfg])
    assert out.shape == (t, e) and out.dtype == torch.float32
    close(out, reference_router_gemm(x, w), 1e-5)


@pytest.mark.parametrize("cfg", ["fma-split", "dot-split", "auto"])
@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t", [1, 5])
def test_router_gemm_half(t, wdt, cfg, device):
    """bf16 / fp16 inputs (the weight possibly kept in fp32): products exact in fp32."""
    xdt = torch.float16 if wdt == torch.float16 else torch.bfloat16
    x = torch.randn(t, 260).to(device, xdt)
    w = (torch.randn(72, 260) / 16).to(device, wdt)
    out = router_gemm_triton(x, w, config=ROUTER_CONFIGS[cfg])
    assert out.dtype == torch.float32
    close(out, reference_router_gemm(x, w), 1e-5)


@pytest.mark.parametrize("cfg", ["fma-split", "dot-split"])
def test_router_split_deterministic_and_resets(cfg, device):
    x, w = torch.randn(4, 260).to(device), torch.randn(40, 260).to(device)
    first = router_gemm_triton(x, w, config=ROUTER_CONFIGS[cfg])
    assert torch.equal(router_gemm_triton(x, w, config=ROUTER_CONFIGS[cfg]), first)  # fixed split order
    x2, w2 = torch.randn(3, 96).to(device), torch.randn(24, 96).to(device)  # the same cached counters
    close(router_gemm_triton(x2, w2, config=ROUTER_CONFIGS[cfg]), reference_router_gemm(x2, w2), 1e-5)
    assert not moe._zeros(x.device, torch.int32, 4).any()


def test_router_config_heuristic():
    bf16, sms = torch.bfloat16, 132
    for e, h in [(128, 2048), (256, 7168), (256, 3072)]:
        for t in (1, 2, 4, 16):
            c = router_config(t, e, h, bf16, bf16, sms)
            programs = -(-e // c["BLOCK_E"]) * c["SPLIT_H"]
            assert c["DOT"] == (t > 2) and c["BLOCK_H"] >= 64 and programs >= sms
            assert c["SPLIT_H"] <= min(32, -(-h // c["BLOCK_H"]))
    big = router_config(4096, 256, 7168, bf16, bf16, sms)
    assert big["SPLIT_H"] == 1 and big["BLOCK_T"] == 64
    assert router_config(64, 256, 7168, bf16, bf16, sms)["SPLIT_H"] <= 32  # (unrolled reduction)
    assert router_config(1, 8, 16, torch.float32, torch.float32, 8)["BLOCK_H"] == 16  # not wider than H
    with pytest.raises(KeyError):
        router_config(1, 8, 16, bf16, bf16, 8, {"BLOCK_N": 4})


# ---- expert selection -------------------------------------------------------------------

def routing_inputs(t, e, scoring, with_bias, n_group, seed=0):
    """Logits (and bias) whose selections have no near-ties: with a bias the biased scores
    are a jittered permutation of a spaced grid (scores = choice - bias, logits through the
    inverse sigmoid / log), else spaced logits; rows whose group scores come within 2e-5
    are drawn again."""
    g = torch.Generator().manual_seed(seed)
    bias = (torch.rand(e, generator=g, dtype=torch.float64) - 0.5) * 0.5 if with_bias else None
    rows = []
    while len(rows) < t:
        grid = (torch.randperm(e, generator=g).double() + 0.3 * torch.rand(e, generator=g, dtype=torch.float64)) / e
        if with_bias:
            choice = 0.3 + 0.4 * grid
            score = choice - bias
            if scoring == "softmax":
                score = score - score.min() + 0.05  # still choice = softmax(logit) + bias' after a shift
                score = score / score.sum()
                choice = score + bias
                logit = score.log()
            else:
                logit = torch.log(score / (1 - score))
        else:
            logit = 6 * grid - 3
            choice = logit
        if n_group > 1:
            grouped = choice.view(n_group, -1)
            gs = grouped.topk(2, -1).values.sum(-1) if with_bias else grouped.max(-1).values
            gs = gs.sort().values
            if (gs[1:] - gs[:-1]).min() < 2e-5:
                continue
        if with_bias and ((c := choice.sort().values)[1:] - c[:-1]).min() < 2e-5:
            continue
        rows.append(logit)
    return torch.stack(rows).float(), (bias.float() if with_bias else None)


def by_id(weights, ids):
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


ROUTINGS = {  # (E, top_k, scoring, bias, n_group, topk_group, renormalize, scaling)
    "qwen3": (128, 8, "softmax", False, 1, 1, True, 1.0),
    "softmax-60-raw": (60, 4, "softmax", False, 1, 1, False, 1.0),
    "deepseek-v3": (256, 8, "sigmoid", True, 8, 4, True, 2.5),
    "minimax-m2": (256, 8, "sigmoid", True, 1, 1, True, 1.0),
    "sigmoid-groupmax": (96, 6, "sigmoid", False, 4, 2, False, 1.0),
    "softmax-bias-3groups": (48, 10, "softmax", True, 3, 2, True, 1.5),
    "tiny": (6, 1, "softmax", False, 1, 1, True, 1.0),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("t", [1, 3, 17])
def test_select_experts(t, name, device):
    """The selection kernel (top-k argmax rounds) against the reference."""
    e, k, scoring, with_bias, ng, tg, renorm, scaling = ROUTINGS[name]
    logits, bias = routing_inputs(t, e, scoring, with_bias, ng, seed=t)
    args = (k, scoring, bias, ng, tg, renorm, scaling)
    ref_w, ref_ids = reference_select_experts(logits, *args)
    dev_args = (logits.to(device), k, scoring, bias.to(device) if with_bias else None, ng, tg, renorm, scaling)
    w, ids = select_experts_triton(*dev_args)
    assert w.shape == ids.shape == (t, k) and w.dtype == torch.float32 and ids.dtype == torch.int32
    w, ids = by_id(w.cpu(), ids.cpu())
    ref_w, ref_ids = by_id(ref_w, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["qwen3", "deepseek-v3", "tiny"])
@pytest.mark.parametrize("t", [1, 5])
def test_select_experts_with_a_stacked_shared_expert(t, name, device):
    """``shared_gate``: the logits' last column gates a shared expert stacked as expert E, entry
    K of every row: id E, weight sigmoid(logit E); the K routed entries as without it (never
    expert E, the shared weight outside renormalisation and scaling); the torch form alike."""
    e, k, scoring, with_bias, ng, tg, renorm, scaling = ROUTINGS[name]
    logits, bias = routing_inputs(t, e, scoring, with_bias, ng, seed=t + 11)
    gate = torch.randn(t, 1, generator=torch.Generator().manual_seed(t))
    logits = torch.cat([logits, gate], 1)
    args = (k, scoring, bias, ng, tg, renorm, scaling)
    w, ids = select_experts_triton(logits.to(device), *args[:2], bias.to(device) if with_bias else None, *args[3:],
                                   shared_gate=True)
    assert w.shape == ids.shape == (t, k + 1)
    w, ids = w.cpu(), ids.cpu()
    routed_w, routed_ids = by_id(*reference_select_experts(logits[:, :e], *args))
    got_w, got_ids = by_id(w[:, :k], ids[:, :k])
    assert torch.equal(got_ids, routed_ids)
    torch.testing.assert_close(got_w, routed_w, rtol=1e-5, atol=1e-6)
    assert ids[:, k].tolist() == [e] * t
    torch.testing.assert_close(w[:, k], torch.sigmoid(gate[:, 0]), rtol=1e-6, atol=1e-7)
    ref_w, ref_ids = by_id(*reference_select_experts(logits, *args, shared_gate=True))
    got_w, got_ids = by_id(w, ids)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-6)


def test_select_experts_lowest_id_on_ties(device):
    logits = torch.zeros(2, 12)
    logits[1, 5] = 1.0
    _, ids = select_experts_triton(logits.to(device), 3)
    assert ids.cpu().tolist() == [[0, 1, 2], [5, 0, 1]]


@pytest.mark.parametrize("kwargs,match", [
    (dict(scoring="relu"), "scoring"), (dict(top_k=0), "top_k"), (dict(top_k=17), "top_k"),
    (dict(n_group=3), "n_group"), (dict(n_group=4, topk_group=5), "topk_group"),
    (dict(n_group=16, bias=torch.zeros(16)), "2 experts per group"), (dict(bias=torch.zeros(15)), "bias"),
])
def test_select_experts_errors(kwargs, match):
    args = dict(top_k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        moe.select_experts(torch.randn(2, 16), **args)


# ---- sorting by expert ------------------------------------------------------------------

def expected_alignment(ids, e, bm):
    flat = ids.reshape(-1).long()
    n = flat.numel()
    runs, experts = [], []
    for ex in range(e):
        rows = (flat == ex).nonzero().squeeze(1)
        if len(rows):
            pad = -len(rows) % bm
            runs.append(torch.cat([rows, torch.full((pad,), n)]))
            experts += [ex] * ((len(rows) + pad) // bm)
    return torch.cat(runs), torch.tensor(experts)


@pytest.mark.parametrize("t,k,e,bm", [(1, 1, 4, 16), (1, 8, 128, 16), (3, 2, 5, 16), (17, 4, 33, 32),
                                      (40, 7, 9, 16), (300, 2, 64, 64), (97, 6, 256, 16)])
def test_moe_align_block_size(t, k, e, bm, device):
    g = torch.Generator().manual_seed(t * 1000 + e)
    hot = torch.rand(e, generator=g) ** 4  # skewed: a few busy experts, some idle
    ids = torch.multinomial(hot.expand(t, e), k, generator=g).int()
    sorted_ids, block_expert, total = moe_align_block_size(ids.to(device), e, bm)
    want_ids, want_experts = expected_alignment(ids, e, bm)
    n = t * k
    assert sorted_ids.numel() % bm == 0 and sorted_ids.numel() >= n + min(e, n) * (bm - 1)
    assert int(total) == want_ids.numel()
    sorted_ids, block_expert = sorted_ids.cpu().long(), block_expert.cpu().long()
    assert torch.equal(sorted_ids[:int(total)], want_ids)
    assert (sorted_ids[int(total):] == n).all()
    assert torch.equal(block_expert[:len(want_experts)], want_experts)
    assert (block_expert[len(want_experts):] == -1).all()


# ---- fused experts ----------------------------------------------------------------------

def moe_inputs(t, e, k, h, inter, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter ** 0.5
    weights, ids = reference_select_experts(torch.randn(t, e, generator=g), k)
    return (x.to(device, dtype), w13.to(device, dtype), w2.to(device, dtype), weights.to(device), ids.to(device))


MOE_CONFIGS = {
    "m16-even": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16},  # K tiles divide H and I
    "m16-ragged": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32},  # I = 40 / 24: ragged K and N tiles
    "m32": {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32},
    "auto": None,
}


@pytest.mark.parametrize("t,e,k,h,inter,cfg", [
    *[(1, 8, 2, 64, 40, c) for c in MOE_CONFIGS], *[(3, 6, 3, 48, 24, c) for c in MOE_CONFIGS],
    (17, 10, 2, 64, 40, "m16-ragged"), (17, 10, 2, 64, 40, "auto")])
def test_fused_moe_fp32(t, e, k, h, inter, cfg, device):
    x, w13, w2, weights, ids = moe_inputs(t, e, k, h, inter, torch.float32, device, seed=t)
    out = fused_moe_triton(x, w13, w2, weights, ids, config=MOE_CONFIGS[cfg])
    assert out.shape == (t, h) and out.dtype == torch.float32
    close(out, reference_fused_moe(x, w13, w2, weights, ids), TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,cfg", [(1, "auto"), (17, "m16-ragged")])
def test_fused_moe_half(t, cfg, dtype, device):
    x, w13, w2, weights, ids = moe_inputs(t, 12, 4, 64, 40, dtype, device, seed=t)
    out = fused_moe_triton(x, w13, w2, weights, ids, config=MOE_CONFIGS[cfg])
    assert out.dtype == dtype
    close(out, reference_fused_moe(x, w13, w2, weights, ids), TOL[dtype])


def test_fused_moe_two_pass_sort(device):
    """T*K above the one-program sort: the counting pass and the scatter pass."""
    x, w13, w2, weights, ids = moe_inputs(70, 10, 4, 32, 24, torch.float32, device, seed=1)
    out = fused_moe_triton(x, w13, w2, weights, ids, config={"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32})
    close(out, reference_fused_moe(x, w13, w2, weights, ids), TOL[torch.float32])


@pytest.mark.parametrize("t,cfg", [(3, "m16-even"), (17, "auto")])
def test_fused_moe_dropped_ids(t, cfg, device):
    """Expert-parallel ranks hold experts [4, 8) of 8: the others' entries come as id -1 with
    weight 0 and must add nothing (the combine skips their unwritten rows). The sum over
    both ranks' halves is the full layer."""
    x, w13, w2, weights, ids = moe_inputs(t, 8, 3, 64, 40, torch.float32, device, seed=t)
    total = torch.zeros_like(x)
    for start in (0, 4):
        local = ids - start
        mine = (local >= 0) & (local < 4)
        args = (x, w13[start:start + 4], w2[start:start + 4], weights * mine, torch.where(mine, local, -1))
        out = fused_moe_triton(*args, config=MOE_CONFIGS[cfg], dropped_ids=True)
        close(out, reference_fused_moe(*args, dropped_ids=True), TOL[torch.float32])
        total += out
    close(total, reference_fused_moe(x, w13, w2, weights, ids), TOL[torch.float32])


def test_moe_config_heuristic():
    bf16, sms = torch.bfloat16, 132
    for t in (1, 4, 16):  # decode: memory-bound tiles that reach most SMs
        for cfg, n in zip(moe_config(t, 8, 128, 2048, 768, bf16, sms), (768, 2048)):
            assert cfg["BLOCK_M"] == 16 and cfg["BLOCK_K"] == 128 and cfg["num_stages"] == 4
            assert min(128, t * 8) * math.ceil(n / cfg["BLOCK_N"]) >= sms // 2
    for e, h, inter in ((128, 2048, 768), (256, 7168, 2048), (256, 3072, 1536)):  # the MoE presets, 1 token:
        assert [c["BLOCK_N"] for c in moe_config(1, 8, e, h, inter, bf16, sms)] == [64, 64]  # 64-wide tiles
    assert moe_config(1, 8, 128, 2048, 256, bf16, sms)[0]["BLOCK_N"] == 16  # narrow experts: 8 x 16 tiles >= 66
    up, down = moe_config(4096, 8, 128, 2048, 768, bf16, sms)
    assert up["BLOCK_M"] == down["BLOCK_M"] == 128 and up["BLOCK_N"] == 64 and down["BLOCK_N"] == 128
    assert moe_config(256, 8, 128, 2048, 768, bf16, sms)[0]["BLOCK_M"] <= 32  # ~16 rows per expert
    assert moe_config(1, 2, 8, 64, 40, torch.float32, 8, {"BLOCK_N": 32})[1]["BLOCK_N"] == 32
    with pytest.raises(KeyError):
        moe_config(1, 2, 8, 64, 40, bf16, 8, {"SPLIT_K": 2})


# ---- dispatch -------------------------------------------------------------------------------

def test_dispatch_cpu_uses_reference():
    x, w13, w2, weights, ids = moe_inputs(5, 8, 2, 32, 16, torch.float32, "cpu")
    gate = torch.randn(8, 32)
    assert torch.equal(moe.router_gemm(x, gate), reference_router_gemm(x, gate))
    logits, bias = torch.randn(5, 8), torch.randn(8)
    got = moe.select_experts(logits, 2, "sigmoid", bias, 2, 1, True, 2.0)
    want = reference_select_experts(logits, 2, "sigmoid", bias, 2, 1, True, 2.0)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(moe.fused_moe(x, w13, w2, weights, ids), reference_fused_moe(x, w13, w2, weights, ids))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_model_shapes():
    dev, dt = "cuda", torch.bfloat16
    for (e, h), name in [((128, 2048), "qwen3"), ((256, 7168), "deepseek-v3"), ((256, 3072), "minimax-m2")]:
        w = torch.randn(e, h, device=dev, dtype=dt) / h ** 0.5
        for t in (1, 4, 16, 100):
            x = torch.randn(t, h, device=dev, dtype=dt)
            close(moe.router_gemm(x, w), reference_router_gemm(x, w), 1e-4)
            _, k, scoring, with_bias, ng, tg, renorm, scaling = ROUTINGS[name]
            logits, bias = routing_inputs(t, e, scoring, with_bias, ng, seed=t)
            got = by_id(*moe.select_experts(logits.to(dev), k, scoring, bias.to(dev) if with_bias else None,
                                            ng, tg, renorm, scaling))
            want = by_id(*reference_select_experts(logits, k, scoring, bias, ng, tg, renorm, scaling))
            assert torch.equal(got[1].cpu(), want[1])
            torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-5, atol=1e-6)
    for t in (1, 16, 256, 2000):
        x, w13, w2, weights, ids = moe_inputs(t, 128, 8, 2048, 768, dt, dev, seed=t)
        close(moe.fused_moe(x, w13, w2, weights, ids), reference_fused_moe(x, w13, w2, weights, ids), 2e-2)
        if t == 1:  # the unsorted two-launch decode path
            close(fused_moe_triton(x, w13, w2, weights, ids, direct=True),
                  reference_fused_moe(x, w13, w2, weights, ids), 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["qwen3", "deepseek-v3", "minimax-m2", "softmax-bias-3groups", "tiny"])
@pytest.mark.parametrize("t,h,resid", [(1, 96, True), (3, 64, True), (2, 80, False)])
def test_norm_route_experts(t, h, resid, name, dtype, device):
    """Residual add + RMSNorm + router GEMM in one launch and the selection kernel after it ==
    the norm kernel's reference then router_gemm + select_experts: the normed rows and the
    residual (fp32: bitwise), the same experts, the weights to fp32 rounding; twice (nothing
    carried over between calls)."""
    e, k, scoring, with_bias, ng, tg, renorm, scaling = ROUTINGS[name]
    g = torch.Generator().manual_seed(t * 7 + e + h)
    x = torch.randn(t, h, generator=g).to(dtype).to(device)
    r = torch.randn(t, h, generator=g).to(dtype).to(device) if resid else None
    nw = (1 + 0.2 * torch.randn(h, generator=g)).to(dtype).to(device)
    w = (torch.randn(e, h, generator=g) / h ** 0.5).to(dtype).to(device)
    bias = (torch.randn(e, generator=g) * 0.1).to(device) if with_bias else None
    args = (k, scoring, bias, ng, tg, renorm, scaling)
    from blitzllm.kernels.norm.rmsnorm import reference_fused_add_rms_norm, reference_rms_norm
    want_h, want_r = (reference_fused_add_rms_norm(x, r, nw, 1e-6) if resid else (reference_rms_norm(x, nw, 1e-6), x))
    cpu_args = [v.cpu() if torch.is_tensor(v) else v for v in args]
    for _ in range(2):
        h_out, r_out, wts, ids = moe.norm_route_experts_triton(x, r, nw, 1e-6, w, *args)
        if dtype == torch.float32:
            torch.testing.assert_close(h_out, want_h, rtol=1e-6, atol=1e-6)
            assert torch.equal(r_out, want_r)
        else:  # bf16 ulps (the interpreter rounds toward zero; bitwise on the GPU: test_gpu_norm_route)
            close(h_out, want_h, TOL[dtype])
            close(r_out, want_r, TOL[dtype])
        # routed as the reference routes the normed rows (bf16: the kernel's own, an ulp
        # apart under the interpreter)
        routed = want_h if dtype == torch.float32 else h_out
        want_w, want_ids = by_id(*reference_select_experts(reference_router_gemm(routed, w).cpu(), *cpu_args))
        got_w, got_ids = by_id(wts.cpu(), ids.cpu())
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w, rtol=1e-4, atol=1e-5)


def test_norm_route_with_a_stacked_shared_expert(device):
    """The norm + router launch over a router with a shared expert's gate as row E routes the E
    experts as the plain router does and adds entry K: expert E, weighted by the sigmoid of the
    normed row's logit on row E."""
    e, k, scoring, with_bias, ng, tg, renorm, scaling = ROUTINGS["qwen3"]
    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(2, 96, generator=g).to(device) for _ in range(2))
    nw = (1 + 0.2 * torch.randn(96, generator=g)).to(device)
    w = (torch.randn(e + 1, 96, generator=g) / 96 ** 0.5).to(device)
    args = (k, scoring, None, ng, tg, renorm, scaling)
    h_out, r_out, wts, ids = moe.norm_route_experts_triton(x, r, nw, 1e-6, w, *args, shared_gate=True)
    plain = moe.norm_route_experts_triton(x, r, nw, 1e-6, w[:e], *args)
    assert torch.equal(h_out, plain[0]) and torch.equal(r_out, plain[1])
    got_w, got_ids = by_id(wts[:, :k].cpu(), ids[:, :k].cpu())
    want_w, want_ids = by_id(plain[2].cpu(), plain[3].cpu())
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    assert ids[:, k].tolist() == [e, e]
    gate = torch.sigmoid(reference_router_gemm(h_out, w[e:])[:, 0])
    torch.testing.assert_close(wts[:, k].cpu(), gate.cpu(), rtol=1e-5, atol=1e-6)


def test_norm_route_rounds_an_fp32_x_first(device):
    """An fp32 x beside a bf16 residual (o_proj's fp32 sum, kernels/oproj_partials.py) gives
    exactly the results of x rounded to bf16 first, in the residual's dtype. (x sits 0.4 of a
    bf16 ulp past a bf16 value, away from zero: rounding to nearest and the interpreter's
    toward zero both give that value, and a sum taken before rounding differs from it.)"""
    e, k, scoring, with_bias, ng, tg, renorm, scaling = ROUTINGS["qwen3"]
    g = torch.Generator().manual_seed(3)
    xb = torch.randn(2, 96, generator=g).to(torch.bfloat16).float()
    ulp = torch.exp2(torch.floor(torch.log2(xb.abs())) - 7)
    x = (xb + 0.4 * ulp * xb.sign()).to(device)
    assert torch.equal(x.cpu().to(torch.bfloat16).float(), xb)
    r = torch.randn(2, 96, generator=g).to(torch.bfloat16).to(device)
    nw = (1 + 0.2 * torch.randn(96, generator=g)).to(torch.bfloat16).to(device)
    w = (torch.randn(e, 96, generator=g) / 96 ** 0.5).to(torch.bfloat16).to(device)
    args = (k, scoring, None, ng, tg, renorm, scaling)
    got = moe.norm_route_experts_triton(x, r, nw, 1e-6, w, *args)
    want = moe.norm_route_experts_triton(x.to(torch.bfloat16), r, nw, 1e-6, w, *args)
    assert got[0].dtype == got[1].dtype == torch.bfloat16
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_norm_route():
    """The norm + router launch and the selection after it at the MoE presets' shapes (bf16, 1-4
    tokens): the normed rows and the residual bitwise those of the RMSNorm kernel, the ids those
    of the router GEMM + selection kernels on them, the weights to fp32 rounding."""
    from blitzllm.kernels.norm.rmsnorm import fused_add_rms_norm_triton
    dev, dt = "cuda", torch.bfloat16
    for name, h in (("qwen3", 2048), ("deepseek-v3", 7168), ("minimax-m2", 3072)):
        e, k, scoring, with_bias, ng, tg, renorm, scaling = ROUTINGS[name]
        g = torch.Generator(device=dev).manual_seed(h)
        w = (torch.randn(e, h, device=dev, generator=g) / h ** 0.5).to(dt)
        nw = (1 + 0.2 * torch.randn(h, device=dev, generator=g)).to(dt)
        bias = torch.randn(e, device=dev, generator=g) * 0.1 if with_bias else None
        args = (k, scoring, bias, ng, tg, renorm, scaling)
        for t in (1, 2, 4):
            x, r = (torch.randn(t, h, device=dev, generator=g).to(dt) for _ in range(2))
            want_h, want_r = fused_add_rms_norm_triton(x, r, nw, 1e-6)
            want_w, want_ids = by_id(*select_experts_triton(router_gemm_triton(want_h, w), *args))
            h_out, r_out, wts, ids = moe.norm_route_experts_triton(x, r, nw, 1e-6, w, *args)
            assert torch.equal(h_out, want_h) and torch.equal(r_out, want_r)
            got_w, got_ids = by_id(wts, ids)
            assert torch.equal(got_ids, want_ids)
            torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
            # a shared gate stacked as router row E: the same routing, then entry K
            gate_row = (torch.randn(1, h, device=dev, generator=g) / h ** 0.5).to(dt)
            _, _, wts, ids = moe.norm_route_experts_triton(x, r, nw, 1e-6, torch.cat([w, gate_row]), *args,
                                                           shared_gate=True)
            got_w, got_ids = by_id(wts[:, :k], ids[:, :k])
            assert torch.equal(got_ids, want_ids) and ids[:, k].tolist() == [e] * t
            torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(wts[:, k], torch.sigmoid(router_gemm_triton(want_h, gate_row)[:, 0]),
                                       rtol=1e-5, atol=1e-6)


def test_norm_route_compiles_for_sm90():
    """The norm + router launch compiles for sm_90 (a stand-in driver, tools/ptxas_check.py) with
    its router rows loaded before the PDL wait, and no spills."""
    from tests.kernels.conftest import sm90_compile
    out = sm90_compile("norm_route()")
    assert "load_before_wait=True" in out and "0 bytes spill stores" in out, out


def test_norm_route_dispatch(monkeypatch):
    """norm_route_experts: the composition off CUDA (== the reference); norm_route_ok only for
    CUDA tensors of 1..NORM_ROUTE_MAX_T rows."""
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    nw, w = torch.rand(64, generator=g) + 0.5, torch.randn(16, 64, generator=g)
    got = moe.norm_route_experts(x, r, nw, 1e-6, w, 4, "sigmoid", torch.zeros(16), 4, 2, True, 2.0)
    want = moe.reference_norm_route_experts(x, r, nw, 1e-6, w, 4, "sigmoid", torch.zeros(16), 4, 2, True, 2.0)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert not moe.norm_route_ok(x)  # CPU tensors
    monkeypatch.setattr(moe, "use_triton", lambda t: True)
    assert moe.norm_route_ok(x) and not moe.norm_route_ok(torch.zeros(moe.NORM_ROUTE_MAX_T + 1, 8))
    assert not moe.norm_route_ok(torch.zeros(0, 8))


def test_route_experts_dispatch_matches_the_two_steps():
    """The layer's routing entry point (CPU: torch) == select_experts(router_gemm(x))."""
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(5, 64, generator=g), torch.randn(32, 64, generator=g)
    got = moe.route_experts(x, w, 4, "sigmoid", torch.zeros(32), 4, 2, True, 2.0)
    ref = moe.select_experts(moe.router_gemm(x, w), 4, "sigmoid", torch.zeros(32), 4, 2, True, 2.0)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,e,k,h,inter,cfg", [(1, 8, 2, 64, 40, "m16-ragged"), (2, 10, 3, 48, 24, "m16-even"),
                                               (1, 6, 6, 96, 72, "auto"), (2, 8, 8, 64, 40, "auto")])
def test_fused_moe_direct(t, e, k, h, inter, cfg, dtype, device):
    """The unsorted decode path (``direct``): one program row per entry, the combine
    inside the down GEMM's launch. Against the reference, with ragged tiles, all experts of a
    token chosen, dropped ids, and twice in a row (the arrival counters reset themselves)."""
    from blitzllm.kernels.moe import experts as fm
    x, w13, w2, weights, ids = moe_inputs(t, e, k, h, inter, dtype, device, seed=t + 3 * k)
    want = reference_fused_moe(x, w13, w2, weights, ids)
    for _ in range(2):
        out = fused_moe_triton(x, w13, w2, weights, ids, config=MOE_CONFIGS[cfg], direct=True)
        assert out.shape == (t, h) and out.dtype == dtype
        close(out, want, TOL[dtype])
    dropped = torch.where(ids % 2 == 0, ids, -1)
    dropped[0] = -1  # a token whose entries are all on other ranks
    w = weights * (dropped >= 0)
    out = fused_moe_triton(x, w13, w2, w, dropped, config=MOE_CONFIGS[cfg], direct=True, dropped_ids=True)
    close(out, reference_fused_moe(x, w13, w2, w, dropped, dropped_ids=True), TOL[dtype])
    assert not out[0].any()
    from blitzllm.kernels._common import device_sms, next_pow2
    down = fm.moe_config(t, k, e, h, inter, dtype, device_sms(x), MOE_CONFIGS[cfg])[1]
    cnt = fm._counters(x.device, next_pow2(t * math.ceil(h / down["BLOCK_N"])))
    assert not cnt.any()  # the launches' own counters, left at 0


@pytest.mark.parametrize("t,e,k,h,inter,cfg", [(1, 8, 2, 64, 40, "m16-ragged"), (2, 10, 3, 48, 24, "m16-even"),
                                               (2, 8, 8, 64, 40, "auto")])
def test_fused_moe_direct_fp32_sum(t, e, k, h, inter, cfg, device):
    """fp32_sum on the direct path: the down programs add their weighted outputs into an fp32
    row with atomics (the gate/up launch zeroes it): the result is the reference's fp32 sum
    before its rounding, every call (a second call into reused memory starts from zero), with
    dropped entries adding nothing; other paths keep x's dtype."""
    x, w13, w2, weights, ids = moe_inputs(t, e, k, h, inter, torch.bfloat16, device, seed=t + 5 * k)
    want = reference_fused_moe(x, w13, w2, weights, ids)
    counted = fused_moe_triton(x, w13, w2, weights, ids, config=MOE_CONFIGS[cfg], direct=True)
    for _ in range(2):
        out = fused_moe_triton(x, w13, w2, weights, ids, config=MOE_CONFIGS[cfg], direct=True, fp32_sum=True)
        assert out.shape == (t, h) and out.dtype == torch.float32
        close(out, want, TOL[torch.bfloat16])
        # the same terms as the counted combine's fp32 sum: the two round alike up to the order of the additions
        close(out.to(torch.bfloat16), counted, 1e-2)
    dropped = torch.where(ids % 2 == 0, ids, -1)
    dropped[0] = -1  # a token whose entries are all on other ranks
    w = weights * (dropped >= 0)
    out = fused_moe_triton(x, w13, w2, w, dropped, config=MOE_CONFIGS[cfg], direct=True, dropped_ids=True,
                           fp32_sum=True)
    assert out.dtype == torch.float32 and not out[0].any()
    close(out, reference_fused_moe(x, w13, w2, w, dropped, dropped_ids=True), TOL[torch.bfloat16])
    sorted_out = fused_moe_triton(x, w13, w2, weights, ids, config=MOE_CONFIGS[cfg], direct=False, fp32_sum=True)
    assert sorted_out.dtype == torch.bfloat16
    close(sorted_out, want, TOL[torch.bfloat16])


def test_fused_moe_dispatches_small_batches_to_direct(device, monkeypatch):
    from blitzllm.kernels.moe import experts as fm
    seen = []
    orig = fm._grouped_gemm
    monkeypatch.setattr(fm, "_grouped_gemm", lambda *a, **kw: seen.append(kw.get("direct", False)) or orig(*a, **kw))
    for t in (1, 2, 3):  # 8 and 16 entries go direct, 24 are sorted
        x, w13, w2, weights, ids = moe_inputs(t, 12, 8, 64, 40, torch.float32, device, seed=t)
        close(fm.fused_moe_triton(x, w13, w2, weights, ids), reference_fused_moe(x, w13, w2, weights, ids),
              TOL[torch.float32])
    assert seen == [True, True, True, True, False, False]


def test_decode_env_config_reaches_direct_launches_only(device, monkeypatch):
    """BLITZ_MOE_DECODE_CONFIG (A/B runs) sets the tiles of the direct (decode) path's two
    launches in calls without a config; sorted batches keep the heuristic; bad values fail
    with the variable's name."""
    from blitzllm.kernels.moe import experts as fm
    monkeypatch.setenv("BLITZ_MOE_DECODE_CONFIG", '{"BLOCK_N": 32, "BLOCK_K": 32}')
    seen = []
    orig = fm._grouped_gemm
    monkeypatch.setattr(fm, "_grouped_gemm", lambda *a, **kw: seen.append((kw.get("direct", False), a[10]["BLOCK_N"],
                                                                              a[10]["BLOCK_K"])) or orig(*a, **kw))
    for t in (1, 3):  # 8 entries go direct, 24 are sorted
        x, w13, w2, weights, ids = moe_inputs(t, 12, 8, 64, 40, torch.float32, device, seed=t)
        close(fm.fused_moe_triton(x, w13, w2, weights, ids), reference_fused_moe(x, w13, w2, weights, ids),
              TOL[torch.float32])
    assert seen[:2] == [(True, 32, 32)] * 2
    assert all(not d for d, _, _ in seen[2:]) and seen[2][1:] != (32, 32)
    monkeypatch.setenv("BLITZ_MOE_DECODE_CONFIG", '{"up": {"BLOCK_N": 16}, "down": {"BLOCK_K": 16}}')
    seen.clear()
    x, w13, w2, weights, ids = moe_inputs(1, 12, 8, 64, 40, torch.float32, device, seed=5)
    close(fm.fused_moe_triton(x, w13, w2, weights, ids), reference_fused_moe(x, w13, w2, weights, ids),
          TOL[torch.float32])
    heur = fm.moe_config(1, 8, 12, 64, 40, torch.float32, fm.device_sms(x))
    assert seen == [(True, 16, heur[0]["BLOCK_K"]), (True, heur[1]["BLOCK_N"], 16)]
    for bad in ('{"BLOCK_Q": 2}', "[64]", "n64", '{"up": {"BLOCK_Q": 2}}', '{"up": {}, "BLOCK_N": 2}',
                '{"down": [1]}'):
        monkeypatch.setenv("BLITZ_MOE_DECODE_CONFIG", bad)
        with pytest.raises(ValueError, match="BLITZ_MOE_DECODE_CONFIG"):
            fm._env_decode_config()


def test_selection_with_a_shared_entry_compiles_for_sm90():
    """The selection launch with a stacked shared expert's entry at Qwen3-Next's routing
    compiles for sm_90 without spills."""
    from tests.kernels.conftest import sm90_compile
    out = sm90_compile("select_experts()")
    assert "shared_gate=True" in out and "0 bytes spill stores" in out, out
