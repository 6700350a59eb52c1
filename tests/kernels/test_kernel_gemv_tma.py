"""The TMA GEMV (kernels/gemv_tma.py): a Gluon kernel, so no interpreter run. Everywhere: its
tile heuristic, and that it compiles for sm_90 with the bulk tensor copies issued before the
PDL wait (a subprocess with a stand-in driver, as scripts/ptxas_check.py). On a GPU: against
the torch reference, including a shared-memory ring that turns, and under a CUDA graph."""
import os
import subprocess
import sys

import pytest
import torch

from blitzllm.kernels import gemv_tma

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("N,K", [(2048, 4096), (5120, 2048), (151936, 2048), (37, 2056), (1000, 768), (8, 16)])
@pytest.mark.parametrize("sms", [132, 8])
@pytest.mark.parametrize("warps", [4, 8, 16])
def test_config_covers_w_evenly_within_the_budget(N, K, sms, warps):
    cfg = gemv_tma.tma_gemv_config(N, K, 2, sms, warps=warps)
    bn, bk, progs, tiles, g = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["programs"], cfg["tiles"], cfg["G"]
    assert tiles * bn >= N > (tiles - 1) * bn  # every row in one tile
    assert cfg["CHUNKS"] * bk >= K > (cfg["CHUNKS"] - 1) * bk
    assert bk <= 256 and bn <= 256 and g <= 256 and bk * 2 % 16 == 0  # TMA box limits
    assert cfg["CHUNKS"] % g == 0 and (g == 1 or K % bk == 0)  # grouped copies only of whole chunks
    assert g * bn * bk * 2 <= max(gemv_tma.TMA_GROUP_BYTES, bn * bk * 2)
    assert 1 <= progs <= min(sms, tiles)
    # the warps split the rows without repeating work
    assert cfg["WN"] == cfg["num_warps"] <= warps and cfg["WN"] <= bn
    copy = g * bn * bk * 2
    per_prog = -(-tiles // progs) * (cfg["CHUNKS"] // g)
    assert cfg["SLOTS"] == max(2, min(per_prog, gemv_tma.TMA_SMEM_BYTES // copy))
    # no other tile size gives the busiest program fewer bytes
    busiest = -(-tiles // progs) * bn * cfg["CHUNKS"] * bk * 2
    for other in gemv_tma._BLOCK_NS:
        t = -(-N // other)
        p = min(t, sms)
        assert -(-t // p) * other * cfg["CHUNKS"] * bk * 2 >= busiest


@pytest.mark.parametrize("N,K", [(2048, 4096), (5120, 2048), (151936, 2048), (1000, 768), (37, 2048), (8, 256)])
@pytest.mark.parametrize("sms", [132, 8])
def test_mma_config_splits_k_into_64_row_operands(N, K, sms):
    """The tensor-core form: R rows x Q parts of K fill the wgmma's 64 rows, K splits into Q parts
    of whole 64-value chunks, every row in one tile, at most one program per SM, and no other
    row count gives the busiest program fewer bytes."""
    cfg = gemv_tma.tma_mma_config(N, K, 2, sms)
    if N // 8 > sms * gemv_tma.TMA_MMA_MAX_TILES * 8:  # (lm_head-sized: too many tiles per program)
        assert cfg is None
        return
    r, q, cpt, tiles, progs = cfg["R"], cfg["Q"], cfg["CPT"], cfg["tiles"], cfg["programs"]
    assert r * q == 64 and cpt * q * 64 == K
    assert tiles * r >= N > (tiles - 1) * r
    assert 1 <= progs <= min(sms, tiles) and cfg["num_warps"] == 4
    assert cfg["T_MAX"] == -(-tiles // progs) <= gemv_tma.TMA_MMA_MAX_TILES
    copies = -(-tiles // progs) * cpt
    assert cfg["SLOTS"] == max(2, min(copies, gemv_tma.TMA_SMEM_BYTES // (64 * 64 * 2)))
    busiest = -(-tiles // progs) * r * K
    for other in gemv_tma._MMA_ROWS:
        if K % (64 // other * 64) == 0:
            t = -(-N // other)
            assert -(-t // min(t, sms)) * other * K >= busiest


@pytest.mark.parametrize("K", [100, 200, 2056])
def test_mma_config_none_where_k_does_not_split(K):
    assert gemv_tma.tma_mma_config(4096, K, 2, 132) is None  # (not a multiple of 64: no part of whole chunks)
    assert gemv_tma.tma_mma_config(4096, 4096, 4, 132) is None  # fp32: no bf16/fp16 wgmma operand


@pytest.mark.skipif(not gemv_tma.HAS_GLUON, reason="needs Triton's Gluon")
def test_compiles_for_sm90_with_copies_before_the_wait():
    """ptxas accepts it (no spills at the heuristic's tiles) and every preload copy comes
    before griddepcontrol.wait in the PTX."""
    code = r"""
import sys
sys.path.insert(0, "scripts"); sys.path.insert(0, ".")
import ptxas_check as pc
import torch
import triton.runtime.driver as drv
drv.set_active(pc._Sm90())
from blitzllm.kernels import gemv_tma as g
for N, K in ((2048, 4096), (5120, 2048), (151936, 2048), (1000, 2056)):
    cfg = g.tma_gemv_config(N, K, 2, 132)
    w = torch.zeros(N, K, dtype=torch.bfloat16); x = torch.zeros(2, K, dtype=torch.bfloat16)
    grouped = K % cfg["BLOCK_K"] == 0
    k = g._gemv_tma_kernel.warmup(g._descriptor(w, cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["G"], grouped), x, x, x,
        1, N, K, K, N, cfg["tiles"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], CHUNKS=cfg["CHUNKS"],
        G=cfg["G"], SLOTS=cfg["SLOTS"], GROUPED=grouped, TWO_ROWS=True, HAS_BIAS=False, USE_PDL=True,
        TPW_K=min(32, cfg["BLOCK_K"] // 8), WN=cfg["WN"], num_warps=cfg["num_warps"],
        grid=(cfg["programs"],))
    ptx = k.asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    before = ptx[:wait].count("cp.async.bulk.tensor")
    print(N, K, cfg["SLOTS"], before, k.metadata.shared, pc.ptxas_report(k))
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
for N, K in ((2048, 4096), (5120, 2048)):  # the tensor-core form at two rows
    c = g.tma_mma_config(N, K, 2, 132)
    w = torch.zeros(N, K, dtype=torch.bfloat16); x = torch.zeros(2, K, dtype=torch.bfloat16)
    r, q = c["R"], c["Q"]
    lay = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    desc = TensorDescriptor(w, [N, q, K // q], [K, K // q, 1], [r, q, 64], lay)
    k = g._gemv_tma_mma_kernel.warmup(desc, x, x, x, 2, N, K, K, N, c["tiles"], R=r, Q=q, CPT=c["CPT"],
        NB=max(8, 2 * q), MP=2, SLOTS=c["SLOTS"], CPT_PAD=c["CPT"], RING=False, T_MAX=c["T_MAX"], HAS_BIAS=True, USE_PDL=True, num_warps=4,
        grid=(c["programs"],))
    ptx = k.asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    print(N, K, c["SLOTS"], ptx[:wait].count("cp.async.bulk.tensor"), k.metadata.shared,
          "wgmma" if "wgmma.mma_async" in ptx[wait:] else "no-wgmma", pc.ptxas_report(k))
"""
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln.split(" ", 5) for ln in r.stdout.strip().splitlines()]
    assert len(lines) == 4 + 2
    for n, k, slots, before, shared, report in lines[:4]:
        assert int(before) == int(slots)  # the whole preload is issued before the wait
        assert int(shared) >= int(slots) * 8 * 256 * 2  # the slots live in shared memory
        assert int(shared) <= 227 * 1024
        assert "0 bytes spill stores" in report, report
    for n, k, slots, before, shared, report in lines[4:]:
        assert int(before) == int(slots)  # the whole preload is issued before the wait
        assert int(shared) >= int(slots) * 64 * 64 * 2 and int(shared) <= 227 * 1024
        assert report.startswith("wgmma ") and "0 bytes spill stores" in report, report


@pytest.mark.skipif(not gemv_tma.HAS_GLUON, reason="needs Triton's Gluon")
def test_norm_form_compiles_for_sm90():
    """The form with the residual add + RMSNorm inside (BLITZ_GEMV_TMA_NORM) compiles for sm_90 at
    qkv shapes, one and two rows, an fp32 x beside a bf16 residual: no spills, the preload still
    before the wait, the new residual stored after it."""
    code = r"""
import sys
sys.path.insert(0, "scripts"); sys.path.insert(0, ".")
import ptxas_check as pc
import torch
import triton.runtime.driver as drv
drv.set_active(pc._Sm90())
from blitzllm.kernels import gemv_tma as g
for N, K, M in ((5120, 2048, 1), (5120, 2048, 2), (4096, 1024, 1)):
    cfg = g.tma_gemv_config(N, K, 2, 132)
    w = torch.zeros(N, K, dtype=torch.bfloat16); x = torch.zeros(M, K); r = torch.zeros(M, K, dtype=torch.bfloat16)
    out = torch.zeros(M, N, dtype=torch.bfloat16)
    k = g._gemv_tma_kernel.warmup(g._descriptor(w, cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["G"], True), x, out, out,
        M, N, K, K, N, cfg["tiles"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], CHUNKS=cfg["CHUNKS"],
        G=cfg["G"], SLOTS=cfg["SLOTS"], GROUPED=True, TWO_ROWS=M > 1, HAS_BIAS=False, USE_PDL=True,
        TPW_K=min(32, cfg["BLOCK_K"] // 8), WN=cfg["WN"], r_ptr=r, nw_ptr=r[0], ro_ptr=r, stride_rm=K,
        stride_rom=K, eps=1e-6, NORM=True, num_warps=cfg["num_warps"], grid=(cfg["programs"],))
    ptx = k.asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    print(N, K, M, cfg["SLOTS"], ptx[:wait].count("cp.async.bulk.tensor"), ptx[wait:].count("st.global"),
          pc.ptxas_report(k))
"""
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln.split(" ", 6) for ln in r.stdout.strip().splitlines()]
    assert len(lines) == 3
    for n, k, m, slots, before, stores, report in lines:
        assert int(before) == int(slots) and int(stores) > 0
        assert "0 bytes spill stores" in report, report


def test_linear_dispatch_off_gpu():
    """On CPU the flagged projections run their torch path (same result as unflagged)."""
    from blitzllm.layers.linear import Linear
    lin = Linear(64, 32)
    torch.nn.init.normal_(lin.weight)
    x = torch.randn(1, 64)
    want = lin(x)
    lin.tma_preload = True
    assert not lin.tma_ok(x)
    assert torch.equal(lin(x), want)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("N,K", [(2048, 4096), (5120, 2048), (1000, 768), (37, 2056)])
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("mma", [False, True])
def test_matches_reference_gpu(N, K, M, ring, mma):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Hopper only")
    g = torch.Generator(device="cuda").manual_seed(N + K + M)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    if mma and gemv_tma.tma_mma_config(N, K, 2, 132) is None:
        pytest.skip("K does not split into the tensor-core form's parts")
    make = gemv_tma.tma_mma_config if mma else gemv_tma.tma_gemv_config
    cfg = make(N, K, 2, 132, smem_bytes=1) if ring else None  # two slots
    if ring:
        per_tile = cfg["CPT"] if mma else cfg["CHUNKS"] // cfg["G"]
        assert cfg["SLOTS"] < -(-cfg["tiles"] // cfg["programs"]) * per_tile  # the ring turns
    for bias in (None, b):
        got = gemv_tma.gemv_tma_triton(x, w, bias, config=cfg, mma=mma).float()
        ref = gemv_tma.reference_gemv_tma(x, w, bias).float()
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("N,K", [(5120, 2048), (4096, 4096), (1000, 768)])
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("x_fp32", [False, True])
def test_norm_form_matches_norm_then_gemv_gpu(N, K, M, x_fp32):
    """The residual add + RMSNorm inside the GEMV == fused_add_rms_norm then the TMA GEMV: the new
    residual bitwise, the output to bf16 rounding (the sum of squares is taken in another order)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Hopper only")
    from blitzllm.kernels.rmsnorm import fused_add_rms_norm
    g = torch.Generator(device="cuda").manual_seed(N + K + M)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) / K ** 0.5
    x = torch.randn(M, K, device="cuda", generator=g)
    x = x if x_fp32 else x.to(torch.bfloat16)
    r = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    nw = (1 + 0.2 * torch.randn(K, device="cuda", generator=g)).to(torch.bfloat16)
    y, res = gemv_tma.gemv_tma_norm_triton(x, r, nw, 1e-6, w)
    h, want_res = fused_add_rms_norm(x, r, nw, 1e-6)
    assert torch.equal(res, want_res)
    torch.testing.assert_close(y.float(), gemv_tma.reference_gemv_tma(h, w).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_in_cuda_graph_gpu():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Hopper only")
    w = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, 2048, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemv_tma.gemv_tma_triton(x, w, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv_tma.gemv_tma_triton(x, w, out=out)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), gemv_tma.reference_gemv_tma(x, w).float(), rtol=1e-2, atol=1e-2)


def test_timeline_dump_summarises_the_latest_launches_per_shape(monkeypatch, tmp_path):
    """BLITZ_GEMV_TMA_TIMES: per shape, each point relative to the launch's first wait (min /
    median / max over programs, averaged over the latest launches), points a form does not stamp
    left out, launches never run (zeros) skipped."""
    path = tmp_path / "times.txt"
    monkeypatch.setattr(gemv_tma, "_TIMES_PATH", str(path))
    monkeypatch.setattr(gemv_tma, "_TIMES", [])
    monkeypatch.setattr(gemv_tma, "_TIMES_POOL", {})
    monkeypatch.setattr(gemv_tma, "_TIMES_SLOTS", 16)
    monkeypatch.setattr("atexit.register", lambda fn: fn)
    for i in range(3):
        t = gemv_tma._diag_times(3, torch.device("cpu"), (2048, 4096, 1, "fma"))
        t[:] = torch.arange(1, 9).repeat(3, 1) * 1000 + i * 100000
        t[1] += 2000  # the second program two us behind the first, the third four
        t[2] += 4000
    gemv_tma._diag_times(3, torch.device("cpu"), (2048, 4096, 1, "fma"))  # captured, never run
    u = gemv_tma._diag_times(2, torch.device("cpu"), (5120, 2048, 2, "mma"))
    u[:] = torch.arange(1, 9).repeat(2, 1) * 1000
    u[:, 4] = 0  # (the tensor-core form does not stamp point 4)
    gemv_tma._dump_times(last=2)
    lines = path.read_text().splitlines()
    assert lines[0].startswith("N 2048 K 4096 rows 1 fma: mean of 2 launches")
    rows = {ln[:46].strip(): [float(v) for v in ln[46:].split()] for ln in lines[1:8]}
    assert rows["wait over"] == [0.0, 2.0, 4.0] and rows["end"] == [4.0, 6.0, 8.0]
    assert rows["start"] == [-2.0, 0.0, 2.0]
    assert lines[8].startswith("N 5120 K 2048 rows 2 mma: mean of 1 launches")
    assert len(lines) == 1 + 7 + 1 + 6 and not any(ln.strip().startswith("first copy in") for ln in lines[9:])
    assert len(gemv_tma._TIMES_POOL) == 1  # one pool: each call a view of its next slot
