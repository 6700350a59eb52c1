"""The sparse-attention kernels' sm_90 compile (DeepSeek-V3.2), for tests/kernels/test_kernel_dsa.py
(imported in the compile subprocess; kept apart from the test module, whose conftest import would
turn the Triton interpreter on)."""
import torch

from blitzllm.kernels.attention import indexer, mla_decode, topk
from blitzllm.kernels.attention.mla_decode import mla_config


def print_dsa_sm90(pc):
    """For the sm_90 compile check (run by ``sm90_compile`` with tools/ptxas_check.py as ``pc``):
    the indexer prep and logits, the top-k and the sparse MLA split kernel at DeepSeek-V3.2 sizes
    (64 index heads of 128, top 2048; 128 heads, latent 512 + rope 64), bf16, 64-token blocks. One
    line each: name, ptxas report."""
    bf, i32 = torch.bfloat16, torch.int32
    hi, d, p, bs, k = 64, 128, 64, 64, 2048
    q, kk = torch.zeros(1, hi, d, dtype=bf), torch.zeros(1, d, dtype=bf)
    cs, lw = torch.zeros(64, p), torch.zeros(d)
    cache = torch.zeros(4, bs, 1, d, dtype=bf)
    i64 = torch.zeros(1, dtype=torch.int64)
    kern = indexer._indexer_prep_kernel.warmup(
        q, kk, i64, cs, lw, lw, i64, cache, q, q.stride(0), q.stride(1), kk.stride(0), cs.stride(0),
        cache.stride(1), q.stride(0), hi, 1e-6, D=d, D_PAD=d, P=p, HALF_PAD=p // 2,
        HB=indexer.PREP_HEADS_PER_PROG, INTERLEAVE=False, num_warps=4, grid=(1, 5))
    print(f"indexer_prep {pc.ptxas_report(kern)}")
    w, bt, lens, out = torch.zeros(1, hi), torch.zeros(1, 64, dtype=i32), torch.zeros(1, dtype=i32), torch.zeros(1, 4096)
    kern = indexer._indexer_logits_kernel.warmup(
        q, w, cache, bt, lens, out, q.stride(0), q.stride(1), w.stride(0), cache.stride(0), cache.stride(1),
        bt.stride(0), out.stride(0), hi, D=d, H_PAD=hi, D_PAD=d, BLOCK_N=indexer.LOGITS_BLOCK_N, BLOCK_SIZE=bs,
        IEEE=False, num_warps=4, grid=(1, 132))
    print(f"indexer_logits {pc.ptxas_report(kern)}")
    cfg = topk.topk_config(k)
    idx = torch.zeros(1, k, dtype=i32)
    hist, counts = torch.zeros(1, 4, 256, dtype=i32), torch.zeros(1, 32, 2, dtype=i32)
    B, C = cfg["BLOCK"], cfg["CHUNK"]
    kern = topk._chunk_hist_kernel.warmup(out, lens, hist, out.stride(0), k, DIGIT=3, BLOCK=B, CHUNK=C,
                                          num_warps=4, grid=(1, 32))
    print(f"topk_hist {pc.ptxas_report(kern)}")
    kern = topk._chunk_count_kernel.warmup(out, lens, hist, counts, out.stride(0), k, BLOCK=B, CHUNK=C,
                                           P_PAD=32, num_warps=4, grid=(1, 32))
    print(f"topk_count {pc.ptxas_report(kern)}")
    kern = topk._topk_write_kernel.warmup(out, lens, hist, counts, idx, out.stride(0), idx.stride(0), K=k,
                                          K_TILE=cfg["K_TILE"], BLOCK=B, CHUNK=C, P_PAD=32,
                                          num_warps=cfg["num_warps"], grid=(1, 32))
    print(f"topk_write {pc.ptxas_report(kern)}")
    h, r = 128, 512
    mc = mla_config(1, h, r, k, 132)
    ql, qr = torch.zeros(1, h, r, dtype=bf), torch.zeros(1, h, p, dtype=bf)
    lat = torch.zeros(4, bs, 1, r + p, dtype=bf)
    part, lse = torch.zeros(1, h, mc["SPLITS"], r), torch.zeros(1, h, mc["SPLITS"])
    kern = mla_decode._mla_split_kernel.warmup(
        ql, qr, lat, bt, lens, ql, part, lse, ql.stride(0), ql.stride(1), qr.stride(0), qr.stride(1),
        lat.stride(0), lat.stride(1), bt.stride(0), ql.stride(0), ql.stride(1), h, 0.1,
        R=r, P=p, R_PAD=r, P_PAD=p, BLOCK_H=mc["BLOCK_H"], BLOCK_N=mc["BLOCK_N"], BLOCK_SIZE=bs, IEEE=False,
        idx_ptr=idx, stride_idx=idx.stride(0), K=k, K_PAD=k, SPARSE=True,
        num_warps=mc["num_warps"], num_stages=mc["num_stages"], grid=(h // mc["BLOCK_H"], mc["SPLITS"], 1))
    print(f"sparse_mla {pc.ptxas_report(kern)}")
