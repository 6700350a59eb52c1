"""The TMA GEMV (kernels/gemv/gemv_tma.py): a Gluon kernel, so no interpreter run. Everywhere: its
tile heuristic, and that it compiles for sm_90 with the bulk tensor copies issued before the
PDL wait (a subprocess with a stand-in driver, as tools/ptxas_check.py). On a GPU: against
the torch reference, including a shared-memory ring that turns, and under a CUDA graph."""
import os
import subprocess
import sys

import pytest
import torch

from blitzllm.kernels.gemv import gemv_tma

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


@pytest.mark.skipif(not gemv_tma.HAS_GLUON, reason="needs Triton's Gluon")
def test_compiles_for_sm90_with_copies_before_the_wait():
    """ptxas accepts it (no spills at the heuristic's tiles) and every preload copy comes
    before griddepcontrol.wait in the PTX."""
    code = r"""
import sys
sys.path.insert(0, "tools"); sys.path.insert(0, ".")
import ptxas_check as pc
import torch
import triton.runtime.driver as drv
drv.set_active(pc._Sm90())
from blitzllm.kernels.gemv import gemv_tma as g
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
"""
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln.split(" ", 5) for ln in r.stdout.strip().splitlines()]
    assert len(lines) == 4
    for n, k, slots, before, shared, report in lines:
        assert int(before) == int(slots)  # the whole preload is issued before the wait
        assert int(shared) >= int(slots) * 8 * 256 * 2  # the slots live in shared memory
        assert int(shared) <= 227 * 1024
        assert "0 bytes spill stores" in report, report


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("N,K", [(2048, 4096), (5120, 2048), (1000, 768), (37, 2056)])
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("ring", [False, True])
def test_matches_reference_gpu(N, K, M, ring):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Hopper only")
    g = torch.Generator(device="cuda").manual_seed(N + K + M)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    cfg = gemv_tma.tma_gemv_config(N, K, 2, 132, smem_bytes=1) if ring else None  # two slots
    if ring:
        assert cfg["SLOTS"] < -(-cfg["tiles"] // cfg["programs"]) * (cfg["CHUNKS"] // cfg["G"])  # the ring turns
    for bias in (None, b):
        got = gemv_tma.gemv_tma_triton(x, w, bias, config=cfg).float()
        ref = gemv_tma.reference_gemv_tma(x, w, bias).float()
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


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
