"""The head-split o_proj that merges the decode attention's partials (kernels/oproj_partials.py):
a Gluon kernel, so no interpreter run. Everywhere: its tile heuristic, its torch reference on
partials from the decode kernel (interpreter on CPU), and that it compiles for sm_90 with its
weight copies issued before the PDL wait. On a GPU: against the reference (one and two rows,
a bias, a shared-memory ring that turns, partials with idle splits) and in a CUDA graph."""
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from blitzllm.kernels import oproj_partials as op  # noqa: E402
from blitzllm.kernels.paged_attention import (  # noqa: E402
    merge_decode_partials, paged_decode_attention_triton, reference_paged_decode_attention)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("N,heads,d", [(2048, 32, 128), (4096, 32, 128), (1024, 16, 128), (2048, 16, 64),
                                       (7168, 128, 128), (1000, 12, 64), (64, 4, 16)])
@pytest.mark.parametrize("sms", [132, 16])
def test_config_covers_the_rows_within_the_budget(N, heads, d, sms):
    cfg = op.oproj_partials_config(N, heads, d, 2, sms)
    if heads > sms:
        assert cfg is None
        return
    bn, tiles, blocks = cfg["BLOCK_N"], cfg["TILES"], cfg["blocks"]
    assert blocks * tiles * bn >= N > (blocks - 1) * tiles * bn  # every row in one block, no empty block
    assert cfg["programs"] == blocks * heads <= sms
    assert 8 <= bn <= 256 and bn * d * 2 <= op.COPY_BYTES  # a TMA box, a copy within the cap
    assert cfg["SLOTS"] == max(1, min(tiles, op.PARTIALS_SMEM_BYTES // (bn * d * 2)))
    assert 1 <= cfg["WN"] == cfg["num_warps"] <= 8


def test_config_none_where_it_does_not_apply():
    assert op.oproj_partials_config(2048, 32, 96, 2, 132) is None  # head_dim not a power of two
    assert op.oproj_partials_config(2048, 256, 128, 2, 132) is None  # more heads than SMs


@pytest.mark.parametrize("seq_lens,hq,hkv,d", [([300], 8, 2, 64), ([5, 130], 4, 4, 32)])
def test_reference_is_o_proj_of_the_attention_output(seq_lens, hq, hkv, d):
    """The torch form on partials from the decode kernel (idle splits included) == o_proj in
    fp32 of the attention's output rounded to its dtype."""
    from tests.kernels.test_kernel_paged_attention import make_cache
    kc, vc, tables, seq = make_cache(seq_lens, hkv, d, 16, torch.bfloat16)
    g = torch.Generator().manual_seed(len(seq_lens))
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(torch.bfloat16)
    w = (torch.randn(96, hq * d, generator=g) / math.sqrt(hq * d)).to(torch.bfloat16)
    bias = torch.randn(96, generator=g).to(torch.bfloat16)
    p = paged_decode_attention_triton(q, kc, vc, tables, seq, d ** -0.5, num_splits=8, partials=True)
    attn = merge_decode_partials(p, d)
    want = attn.flatten(1).float() @ w.float().t() + bias.float()
    got = op.reference_oproj_partials(p, w, bias)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ref_attn = reference_paged_decode_attention(q, kc, vc, tables, seq, d ** -0.5)
    torch.testing.assert_close(attn.float(), ref_attn.float(), rtol=2.5e-2, atol=2.5e-2)


def test_dispatch_off_gpu():
    w = torch.zeros(64, 128, dtype=torch.bfloat16)
    assert not op.oproj_partials_ok(torch.zeros(1, 384, dtype=torch.bfloat16), w, 4, 32)


@pytest.mark.skipif(not op.HAS_GLUON, reason="needs Triton's Gluon")
def test_compiles_for_sm90_with_copies_before_the_wait():
    """ptxas accepts it without spills at the heuristic's tiles (one and two rows, a ring), every
    preload copy comes before griddepcontrol.wait, and the products leave as fp32 atomic adds."""
    code = r"""
import sys
sys.path.insert(0, "scripts"); sys.path.insert(0, ".")
import ptxas_check as pc
import torch, triton
import triton.runtime.driver as drv
drv.set_active(pc._Sm90())
from blitzllm.kernels import oproj_partials as op
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
for N, hq, d, M, S in ((2048, 32, 128, 1, 32), (4096, 32, 128, 2, 16), (2048, 16, 64, 2, 8)):
    c = op.oproj_partials_config(N, hq, d, 2, 132)
    w = torch.zeros(N, hq * d, dtype=torch.bfloat16)
    m = torch.zeros(M, hq, S); acc = torch.zeros(M, hq, S, d); seq = torch.zeros(M, dtype=torch.int32)
    out = torch.zeros(M, N)
    lay = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3)
    desc = TensorDescriptor(w, [hq, N, d], [d, hq * d, 1], [1, c["BLOCK_N"], d], lay)
    k = op._oproj_partials_kernel.warmup(desc, m, m, acc, seq, out, out, M, N, hq, N,
        NUM_SPLITS=S, S_PAD=triton.next_power_of_2(S), D=d, KV_BN=32, BLOCK_N=c["BLOCK_N"], TILES=c["TILES"],
        SLOTS=c["SLOTS"], TWO_ROWS=M > 1, HAS_BIAS=M > 1, USE_PDL=True, TPW_K=min(32, d // 8),
        TPW_S=min(32, d // 4), WN=c["WN"], num_warps=c["num_warps"], grid=(c["programs"],))
    ptx = k.asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    print(N, c["SLOTS"], c["TILES"], ptx[:wait].count("cp.async.bulk.tensor"), "red" if "red.global" in ptx[wait:] or
          "atom.global" in ptx[wait:] else "none", pc.ptxas_report(k))
"""
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln.split(" ", 5) for ln in r.stdout.strip().splitlines()]
    assert len(lines) == 3
    assert int(lines[1][1]) < int(lines[1][2])  # the second shape's ring turns
    for n, slots, tiles, before, red, report in lines:
        assert int(before) == int(slots)  # the whole preload is issued before the wait
        assert red == "red" and "0 bytes spill stores" in report, report


def _partials(M, hq, hkv, d, seq_lens, splits, seed):
    from tests.kernels.test_kernel_paged_attention import make_cache
    kc, vc, tables, seq = make_cache(seq_lens, hkv, d, 16, torch.bfloat16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(M, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return paged_decode_attention_triton(q, kc, vc, tables, seq, d ** -0.5, num_splits=splits, partials=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("N,hq,hkv,d,seq_lens,splits", [(2048, 32, 4, 128, [200], 32), (2048, 32, 4, 128, [7, 900], 16),
                                                        (1000, 16, 8, 64, [33, 1], 4), (4096, 32, 8, 128, [130], 8)])
@pytest.mark.parametrize("ring", [False, True])
def test_matches_reference_gpu(N, hq, hkv, d, seq_lens, splits, ring):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Hopper only")
    M = len(seq_lens)
    p = _partials(M, hq, hkv, d, seq_lens, splits, seed=N + M)
    g = torch.Generator(device="cuda").manual_seed(N)
    w = torch.randn(N, hq * d, device="cuda", dtype=torch.bfloat16, generator=g) / math.sqrt(hq * d)
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g)
    cfg = None
    if ring:
        cfg = op.oproj_partials_config(N, hq, d, 2, torch.cuda.get_device_properties(0).multi_processor_count,
                                       smem_bytes=1)  # one slot
        if cfg["TILES"] == 1:
            pytest.skip("one tile per program: no ring")
    for bias in (None, b):
        out = torch.zeros(M, N, device="cuda")
        got = op.oproj_partials_triton(p, w, out, bias, config=cfg)
        torch.testing.assert_close(got, op.reference_oproj_partials(p, w, bias), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_in_cuda_graph_gpu():
    """Captured with the attention launch that zeroes its output: replays with new queries."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Hopper only")
    from tests.kernels.test_kernel_paged_attention import make_cache
    hq, hkv, d, N = 32, 4, 128, 2048
    kc, vc, tables, seq = make_cache([200], hkv, d, 16, torch.bfloat16, "cuda")
    q = torch.randn(1, hq, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, hq * d, device="cuda", dtype=torch.bfloat16) / math.sqrt(hq * d)
    out = torch.empty(1, N, device="cuda")
    box = {}

    def step():
        box["p"] = paged_decode_attention_triton(q, kc, vc, tables, seq, d ** -0.5, partials=True, zero=out)
        op.oproj_partials_triton(box["p"], w, out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, op.reference_oproj_partials(box["p"], w), rtol=1e-3, atol=1e-3)
