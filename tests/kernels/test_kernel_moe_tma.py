"""The one-launch TMA MoE (kernels/moe_tma.py): a Gluon kernel, so no interpreter run.
Everywhere: its tile heuristic, and that it compiles for sm_90 without spills (a subprocess
with a stand-in driver, as scripts/ptxas_check.py). On a GPU: against the torch reference at
the MoE presets' expert shapes, launch after launch (the handoff counters reset), under a
CUDA graph, and that ``fused_moe_triton`` dispatches to it. The same for its down-only form
(``moe_tma_down_triton``, BLITZ_MOE_TMA_DOWN=1: the direct path's down GEMM, weight copies
issued before its PDL wait), in a CUDA graph behind the routing and gate/up launches that
produce its inputs."""
import os
import subprocess
import sys

import pytest
import torch

from blitzllm.kernels import moe_tma

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_CUDA = torch.cuda.is_available()
# (H, I, top_k) of qwen3-30b-a3b, minimax-m2, deepseek-v3
PRESET_SHAPES = [(2048, 768, 8), (3072, 1536, 8), (7168, 2048, 8)]


@pytest.mark.parametrize("H,I,K", PRESET_SHAPES + [(1024, 512, 4), (4096, 256, 2), (1536, 512, 8)])
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("sms", [132, 16])
def test_config_covers_the_work_within_shared_memory(H, I, K, T, sms):
    cfg = moe_tma.moe_tma_config(T, H, I, K, 2, sms)
    assert cfg is not None
    bn, bk, g = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["G"]
    assert g * bn * bk * 2 == moe_tma.MOE_TMA_COPY_BYTES and bk <= 256 and bn <= 256 and g <= 256
    assert I % bn == 0 and H % bn == 0  # whole row tiles
    # every chunk of a row in exactly one copy, no copy past a row's end
    assert cfg["GUC"] * cfg["GG"] == H // bk and cfg["DNC"] * cfg["GD"] == I // bk
    assert 1 <= cfg["GG"] <= g and 1 <= cfg["GD"] <= g
    assert cfg["GG"] == max(d for d in range(1, g + 1) if (H // bk) % d == 0)
    assert cfg["GD"] == max(d for d in range(1, g + 1) if (I // bk) % d == 0)
    for whole, box in ((cfg["GG"], cfg["GGB"]), (cfg["GD"], cfg["GDB"])):  # boxes: powers of two that tile a copy
        assert box & (box - 1) == 0 and whole % box == 0
    assert cfg["programs"] == sms  # one per SM: contiguous tile ranges
    buffers = cfg["SLOTS"] * g * bn * bk * 2 + (cfg["T_PAD"] * _pow2(cfg["GUC"] * g)
                                                 + cfg["T_PAD"] * K * _pow2(cfg["DNC"] * g)) * bk * 2
    assert cfg["SLOTS"] >= 3 and buffers <= moe_tma.MOE_TMA_SMEM <= 227 * 1024
    assert cfg["num_warps"] == cfg["WN"] <= bn


def _pow2(n):
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("H,I,K", PRESET_SHAPES + [(1024, 512, 4), (4096, 256, 2), (1536, 512, 8)])
@pytest.mark.parametrize("T", [1, 2])
def test_down_config_covers_the_work_within_shared_memory(H, I, K, T):
    cfg = moe_tma.moe_tma_down_config(T, H, I, K, 2, 132)
    assert cfg is not None
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    # one whole 256-value chunk per copy, every chunk of a down row in one of the tile's DNC copies
    assert cfg["G"] == cfg["GD"] == cfg["GDB"] == 1 and bk == 256 and cfg["DNC"] * bk == I
    assert H % bn == 0 and bn <= 32 and bn * bk * 2 == moe_tma.MOE_TMA_DOWN_COPY_BYTES
    buffers = cfg["SLOTS"] * bn * bk * 2 + (cfg["T_PAD"] + cfg["T_PAD"] * K * _pow2(cfg["DNC"])) * bk * 2
    assert cfg["SLOTS"] >= 3 and buffers <= moe_tma.MOE_TMA_SMEM <= 227 * 1024
    if (T, H, I, K) == (1, 2048, 768, 8):  # qwen3-30b-a3b at one token: every program's share preloaded
        tiles = K * H // bn
        assert cfg["SLOTS"] >= -(-tiles // cfg["programs"]) * cfg["DNC"]


def test_down_config_declines_what_it_cannot_tile():
    assert moe_tma.moe_tma_down_config(3, 2048, 768, 8, 2, 132) is None
    assert moe_tma.moe_tma_down_config(1, 2048, 100, 8, 2, 132) is None
    assert moe_tma.moe_tma_down_config(2, 7168, 2048, 8, 2, 132, smem_bytes=60 << 10) is None


@pytest.mark.parametrize("T,H,I,K", [(3, 2048, 768, 8), (1, 2048, 100, 8), (1, 1000, 768, 8)])
def test_config_declines_what_it_cannot_tile(T, H, I, K):
    assert moe_tma.moe_tma_config(T, H, I, K, 2, 132) is None


def test_config_declines_when_shared_memory_is_short():
    assert moe_tma.moe_tma_config(2, 7168, 2048, 8, 2, 132, smem_bytes=100 << 10) is None


def test_off_gpu_not_taken():
    x = torch.randn(1, 2048, dtype=torch.bfloat16)
    w13 = torch.zeros(4, 2 * 768, 2048, dtype=torch.bfloat16)
    w2 = torch.zeros(4, 2048, 768, dtype=torch.bfloat16)
    assert not moe_tma.moe_tma_ok(x, w13, w2, torch.zeros(1, 2, dtype=torch.int32))


@pytest.mark.skipif(not moe_tma.HAS_GLUON, reason="needs Triton's Gluon")
def test_compiles_for_sm90_without_spills():
    """ptxas accepts the kernel at the presets' shapes (one token) with no spills, the weight
    copies are bulk tensor copies, and the handoff is one release add and acquire loads."""
    code = r"""
import sys
sys.path.insert(0, "scripts"); sys.path.insert(0, ".")
import ptxas_check as pc
import torch
import triton.runtime.driver as drv
drv.set_active(pc._Sm90())
from blitzllm.kernels import moe_tma as m
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
bf = torch.bfloat16
for H, I, K in ((2048, 768, 8), (3072, 1536, 8), (7168, 2048, 8)):
    E = 4
    cfg = m.moe_tma_config(1, H, I, K, 2, 132)
    bn, bk, g = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["G"]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3)
    w13 = torch.zeros(E, 2 * I, H, dtype=bf); w2 = torch.zeros(E, H, I, dtype=bf)
    d13 = TensorDescriptor(w13, [H // bk, E * 2 * I, bk], [bk, H, 1], [cfg["GGB"], bn, bk], layout)
    d2 = TensorDescriptor(w2, [I // bk, E * H, bk], [bk, I, 1], [cfg["GDB"], bn, bk], layout)
    x = torch.zeros(1, H, dtype=bf)
    k = m._moe_tma_kernel.warmup(d13, d2, x, torch.zeros(K, dtype=torch.int32), torch.zeros(K),
        torch.zeros(K, I, dtype=bf), torch.zeros(K, H, dtype=bf), x, torch.zeros(2 + 2 * H // bn, dtype=torch.int32),
        1, H, I, H, H,
        BLOCK_N=bn, BLOCK_K=bk, G=g, GG=cfg["GG"], GD=cfg["GD"], GGB=cfg["GGB"], GDB=cfg["GDB"], GUC=cfg["GUC"], DNC=cfg["DNC"], TOP_K=K, T_PAD=1, DN_MAX=1 << (-(-K * (H // bn) // 132) - 1).bit_length(), SLOTS=cfg["SLOTS"],
        WN=cfg["WN"], USE_PDL=True, num_warps=cfg["num_warps"], grid=(cfg["programs"],))
    ptx = k.asm["ptx"]
    print(H, I, ptx.count("cp.async.bulk.tensor"), ptx.count("atom.global.gpu.release.add"),
          ptx.count("ld.global.gpu.acquire"), k.metadata.shared, pc.ptxas_report(k))
    # the down-only form: its copies issued before the PDL wait, no handoff
    cfg = m.moe_tma_down_config(1, H, I, K, 2, 132)
    bn = cfg["BLOCK_N"]
    d2 = TensorDescriptor(w2, [I // bk, E * H, bk], [bk, I, 1], [1, bn, bk], layout)
    k = m._moe_tma_kernel.warmup(d2, d2, x, torch.zeros(K, dtype=torch.int32), torch.zeros(K),
        torch.zeros(K, I, dtype=bf), torch.zeros(K, H, dtype=bf), x, torch.zeros(2 + 2 * H // bn, dtype=torch.int32),
        1, H, I, H, H,
        BLOCK_N=bn, BLOCK_K=bk, G=1, GG=1, GD=1, GGB=1, GDB=1, GUC=1, DNC=cfg["DNC"], TOP_K=K, T_PAD=1,
        DN_MAX=1 << (-(-K * (H // bn) // 132) - 1).bit_length(), SLOTS=cfg["SLOTS"], WN=cfg["WN"], USE_PDL=True,
        LATE_DEPS=True, DOWN_ONLY=True, num_warps=cfg["num_warps"], grid=(cfg["programs"],))
    ptx = k.asm["ptx"]
    early = 0 <= ptx.find("cp.async.bulk.tensor") < ptx.find("griddepcontrol.wait")
    print(H, I, ptx.count("cp.async.bulk.tensor"), ptx.count("atom.global.gpu.release.add"), int(early),
          k.metadata.shared, pc.ptxas_report(k))
"""
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln.split(" ", 6) for ln in r.stdout.strip().splitlines()]
    assert len(lines) == 6
    for j, (h, i, copies, release, third, shared, report) in enumerate(lines):
        if j % 2 == 0:
            assert int(copies) >= 2  # the gate/up and the down descriptor
            assert int(release) == 1 and int(third) >= 1  # the handoff: a release add, acquire loads
        else:  # down only
            assert int(copies) >= 2  # the preload and the ring's refills
            assert int(release) == 0 and third == "1"  # no handoff; the first copy before the wait
        assert int(shared) <= 227 * 1024
        assert "0 bytes spill stores" in report, report


def _case(E, H, I, K, T, seed, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    bf = torch.bfloat16
    x = torch.randn(T, H, device=device, generator=g).to(bf)
    w13 = (torch.randn(E, 2 * I, H, device=device, generator=g) * H ** -0.5).to(bf)
    w2 = (torch.randn(E, H, I, device=device, generator=g) * I ** -0.5).to(bf)
    ids = torch.stack([torch.randperm(E, device=device, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, K, device=device, generator=g)
    return x, w13, w2, tw / tw.sum(-1, keepdim=True), ids


def _hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Hopper only")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("H,I,K", PRESET_SHAPES)
@pytest.mark.parametrize("T", [1, 2])
def test_matches_reference_gpu(monkeypatch, H, I, K, T):
    _hopper()
    monkeypatch.setattr(moe_tma, "MOE_TMA", "1")
    x, w13, w2, tw, ids = _case(12, H, I, K, T, seed=H + I + T)
    if T == 2:
        ids[1, :2] = ids[0, :2]  # the tokens share some experts
    assert moe_tma.moe_tma_ok(x, w13, w2, ids)
    ref = moe_tma.reference_moe_tma(x, w13, w2, tw, ids).float()
    for _ in range(3):  # launch after launch: the handoff counters are left at 0
        got = moe_tma.moe_tma_triton(x, w13, w2, tw, ids).float()
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    cnt = moe_tma._counters(x.device, 2 + moe_tma.MOE_TMA_MAX_TOKENS * H // 16)
    assert not cnt.any()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("H,I", [(2048, 768), (1536, 512)])
def test_small_ring_and_few_programs_gpu(H, I):
    """A ring that turns many times (three slots) and fewer programs than tiles; copies of 4 and 3
    chunks (qwen3-30b-a3b's down rows: 768 = 3 x 256, three 1-chunk boxes), 3 and 2 chunks (H = 1536,
    I = 512) in one ring."""
    _hopper()
    x, w13, w2, tw, ids = _case(10, H, I, 8, 1, seed=5)
    cfg = dict(moe_tma.moe_tma_config(1, H, I, 8, 2, 132), SLOTS=3, programs=7)
    got = moe_tma.moe_tma_triton(x, w13, w2, tw, ids, config=cfg).float()
    torch.testing.assert_close(got, moe_tma.reference_moe_tma(x, w13, w2, tw, ids).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_in_cuda_graph_gpu():
    _hopper()
    x, w13, w2, tw, ids = _case(16, 2048, 768, 8, 1, seed=3)
    out = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe_tma.moe_tma_triton(x, w13, w2, tw, ids, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(4):  # back to back, as layer after layer
            moe_tma.moe_tma_triton(x, w13, w2, tw, ids, out=out)
    g = torch.Generator(device="cuda").manual_seed(11)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", generator=g))
        ids.copy_(torch.randperm(16, device="cuda", generator=g)[:8][None])
        graph.replay()
        torch.cuda.synchronize()
        ref = moe_tma.reference_moe_tma(x, w13, w2, tw, ids).float()
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_fused_moe_dispatches_to_it_gpu(monkeypatch):
    """fused_moe_triton takes the one launch at 1-2 tokens only with BLITZ_MOE_TMA=1 (off by
    default), not with an explicit config or a forced direct path, nor with dropped ids; its
    result matches the direct path's."""
    _hopper()
    from blitzllm.kernels import fused_moe
    x, w13, w2, tw, ids = _case(12, 2048, 768, 8, 2, seed=9)
    calls = []
    orig = moe_tma.moe_tma_triton
    monkeypatch.setattr(moe_tma, "moe_tma_triton", lambda *a, **k: calls.append(1) or orig(*a, **k))
    monkeypatch.setattr(moe_tma, "MOE_TMA", "0")
    direct = fused_moe.fused_moe_triton(x, w13, w2, tw, ids)
    assert calls == []
    monkeypatch.setattr(moe_tma, "MOE_TMA", "1")
    got = fused_moe.fused_moe_triton(x, w13, w2, tw, ids)
    assert calls == [1]
    fused_moe.fused_moe_triton(x, w13, w2, tw, ids, direct=True)
    fused_moe.fused_moe_triton(x, w13, w2, tw, ids, dropped_ids=True)
    assert calls == [1]
    torch.testing.assert_close(got.float(), direct.float(), rtol=2e-2, atol=2e-2)


def _down_inputs(x, w13, w2, tw, ids):
    """The direct path's gate/up output for the down launch: act [T * K, I], rounded as the reference."""
    T, K = ids.shape
    I = w2.shape[2]
    rows = []
    for t in range(T):
        for k in range(K):  # the steps of moe.reference_fused_moe
            h = x[t:t + 1] @ w13[int(ids[t, k])].t()
            rows.append(torch.nn.functional.silu(h[:, :I].float()).to(x.dtype) * h[:, I:])
    return torch.cat(rows).contiguous()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("H,I,K", PRESET_SHAPES)
@pytest.mark.parametrize("T", [1, 2])
def test_down_matches_reference_gpu(H, I, K, T):
    _hopper()
    x, w13, w2, tw, ids = _case(12, H, I, K, T, seed=H + I + T + 1)
    if T == 2:
        ids[1, :2] = ids[0, :2]
    act = _down_inputs(x, w13, w2, tw, ids)
    ref = moe_tma.reference_moe_tma(x, w13, w2, tw, ids).float()
    out = torch.empty_like(x)
    for _ in range(3):  # launch after launch: the combine counters are left at 0
        out.zero_()
        moe_tma.moe_tma_down_triton(act, w13, w2, tw, ids, out)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    bn = moe_tma.moe_tma_down_config(T, H, I, K, 2, 132)["BLOCK_N"]
    assert not moe_tma._counters(x.device, 2 + moe_tma.MOE_TMA_MAX_TOKENS * H // bn).any()
    # a small ring that turns many times, fewer programs than tiles
    cfg = dict(moe_tma.moe_tma_down_config(T, H, I, K, 2, 132), SLOTS=3, programs=7)
    moe_tma.moe_tma_down_triton(act, w13, w2, tw, ids, out, config=cfg)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_down_in_cuda_graph_behind_routing_gpu(monkeypatch):
    """BLITZ_MOE_TMA_DOWN=1 in a CUDA graph of four MoE layers as decode runs them: the expert
    selection, then fused_moe_triton's gate/up launch and the down launch, which reads the ids
    before its PDL wait (written by the selection two launches before); each replay with new
    router logits and inputs matches the reference, and the TMA down launch ran."""
    _hopper()
    from blitzllm.kernels import fused_moe
    from blitzllm.kernels.moe import select_experts_triton
    monkeypatch.setattr(moe_tma, "MOE_TMA_DOWN", True)
    calls = []
    orig = moe_tma.moe_tma_down_triton
    monkeypatch.setattr(moe_tma, "moe_tma_down_triton", lambda *a, **k: calls.append(1) or orig(*a, **k))
    E, H, I, K = 32, 2048, 768, 8
    layers = [_case(E, H, I, K, 1, seed=20 + i) for i in range(4)]
    x = layers[0][0].clone()
    logits = torch.zeros(4, 1, E, device="cuda")

    def run():
        h = x
        outs = []
        for i, (_, w13, w2, _, _) in enumerate(layers):
            tw, ids = select_experts_triton(logits[i], K)
            h = fused_moe.fused_moe_triton(h, w13, w2, tw, ids)
            outs.append((h, tw, ids))
        return outs

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    assert calls, "the TMA down launch did not run"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    g = torch.Generator(device="cuda").manual_seed(13)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", generator=g))
        logits.copy_(torch.randn(logits.shape, device="cuda", generator=g))
        graph.replay()
        torch.cuda.synchronize()
        h = x
        for i, (_, w13, w2, _, _) in enumerate(layers):
            ref_tw, ref_ids = select_experts_triton(logits[i], K)
            got, tw, ids = outs[i]
            assert torch.equal(ids, ref_ids)
            ref = moe_tma.reference_moe_tma(h, w13, w2, tw, ids)
            torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
            h = got
