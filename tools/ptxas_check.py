#!/usr/bin/env python3
"""Compile Triton kernels for sm_90 on a machine without a GPU (a stand-in driver gives
Triton the target; CPU tensors give it argument types and alignments) and print ptxas's
register / spill report and whether the PTX holds given instructions. The kernel tests' sm_90
compile checks run its functions (tests/kernels/conftest.py ``sm90_compile``).

    python3 tools/ptxas_check.py   # the fused decode attention, the decode GEMV at its heuristic
                                   # configs, the direct MoE gate/up GEMM, the norm + router launch,
                                   # the expert selection, the FP8 weight kernels, the LoRA kernels
                                   # and the attention kernels over an fp8 KV cache
"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import triton  # noqa: E402
import triton.runtime.driver as drv  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402


class _Sm90:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_device_interface(self):
        return torch.cuda


def ptxas_report(kernel) -> str:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(kernel.asm["ptx"])
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    return " | ".join(line.split("info    : ")[-1].strip() for line in r.stderr.splitlines()
                      if "registers" in line or "spill" in line)


def decode_attention():
    """The fused decode attention kernel (q/k norm + rotary + cache write + split-K), Qwen3-0.6B
    heads: registers and spills."""
    import blitzllm.kernels.attention.paged as pa
    bf = torch.bfloat16
    hq, hkv, d, bs = 16, 8, 128, 16
    kc = torch.zeros(10, bs, hkv, d, dtype=bf)
    qkv = torch.zeros(1, (hq + 2 * hkv) * d, dtype=bf)
    out = torch.zeros(1, hq, d, dtype=bf)
    m = torch.zeros(1, hq, 32)
    acc = torch.zeros(1, hq, 32, 128)
    i32 = torch.zeros(64, dtype=torch.int32)
    i64 = torch.zeros(1, dtype=torch.int64)
    w = torch.zeros(d, dtype=bf)
    k = pa._decode_kernel.warmup(
        qkv, kc, kc, i32[None], i32, out, m, m, acc, i32, qkv.stride(0), d, out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), kc.stride(0), kc.stride(1), kc.stride(2), 64, 0.1, 2,
        NUM_SPLITS=32, G_PAD=16, D=d, D_PAD=d, BLOCK_N=32, BLOCK_SIZE=bs, IEEE=False, EARLY_V=True,
        FUSED_REDUCE=True, USE_PDL=1, G_COMB=2, COMBINE=16, pos_ptr=i64, cs_ptr=m, stride_cs=128,
        qw_ptr=w, kw_ptr=w, slot_ptr=i64, Hq=hq, eps=1e-6, FUSE_QK=True, HAS_NORM=True, ROT=d,
        grid=(1, hkv, 32), num_warps=4, num_stages=2)
    print(f"decode attention: {ptxas_report(k)}")


def gemv():
    """The decode GEMV at its heuristic configs for Llama-3.1-8B / Qwen3-0.6B shapes, one row,
    with PDL."""
    from blitzllm.kernels.gemv import gemv as gm
    bf = torch.bfloat16
    shapes = [("llama qkv", 6144, 4096, False), ("llama o_proj", 4096, 4096, False),
              ("llama down", 4096, 14336, False), ("qwen qkv", 4096, 1024, False), ("qwen o_proj", 1024, 2048, False),
              ("qwen gate_up", 6144, 1024, False), ("qwen down+silu", 1024, 3072, True)]
    for name, N, K, silu in shapes:
        cfg = gm.gemv_config(1, N, K, bf, 132, None, silu)
        x = torch.zeros(1, 2 * K if silu else K, dtype=bf)
        w = torch.zeros(N, K, dtype=bf)
        ws = torch.zeros(1 << 20)
        kps = triton.cdiv(triton.cdiv(K, cfg["BLOCK_K"]), cfg["SPLIT_K"]) * cfg["BLOCK_K"]
        k = gm._gemv_kernel.warmup(
            x, w, w, torch.zeros(1, N, dtype=bf), ws, torch.zeros(4096, dtype=torch.int32),
            1, N, K, x.stride(0), w.stride(0), N, kps, cfg["SPLIT_K"],
            M_PAD=1, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT=cfg["SPLIT_K"] > 1, DOT=cfg["DOT"],
            IEEE=False, SILU_MUL=silu, HAS_BIAS=False, USE_PDL=1, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"], grid=(triton.cdiv(N, cfg["BLOCK_N"]), cfg["SPLIT_K"]))
        tiles = {key: cfg[key] for key in ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps")}
        print(f"gemv {name} {tiles}: {ptxas_report(k)}")


def moe_direct():
    """The direct (decode) fused-MoE gate/up GEMM at Qwen3-30B-A3B sizes, one token."""
    from blitzllm.kernels.moe import experts as fm
    bf = torch.bfloat16
    e, h, inter, k = 128, 2048, 768, 8
    up, _ = fm.moe_config(1, k, e, h, inter, bf, 132)
    x, act = torch.zeros(1, h, dtype=bf), torch.zeros(k, inter, dtype=bf)
    w13 = torch.zeros(e, 2 * inter, h, dtype=bf)
    ids = torch.zeros(k, dtype=torch.int32)
    kern = fm._moe_gemm_kernel.warmup(
        x, w13, act, ids, ids, ids, inter, h, k, k, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        act, act, act, act.stride(0), BLOCK_M=16, BLOCK_N=up["BLOCK_N"], BLOCK_K=up["BLOCK_K"],
        GATED=True, EVEN_K=True, IEEE=False, USE_PDL=1, DIRECT=True, COMBINE=False, TOP_K=1,
        num_warps=up["num_warps"], num_stages=up["num_stages"], grid=(k, triton.cdiv(inter, up["BLOCK_N"])))
    print(f"moe direct gate/up {up}: {ptxas_report(kern)} | bar.sync sites {kern.asm['ptx'].count('bar.sync')}")


def norm_route():
    """The MoE norm + router launch at Qwen3-30B-A3B sizes, one token: the router rows load before
    the PDL wait. One line: the wait's index in the PTX against the first global load's, and
    ptxas's report."""
    from blitzllm.kernels.moe import router as moe
    bf = torch.bfloat16
    e, h = 128, 2048
    x, w = torch.zeros(1, h, dtype=bf), torch.zeros(e, h, dtype=bf)
    logits = torch.zeros(1, e)
    kern = moe._norm_route_kernel.warmup(
        x, x, x[0], w, x, x, logits, 1, e, h, h, h, h, h, h, 1e-6,
        BLOCK_E=1, BLOCK_H=h, HAS_RESIDUAL=True, USE_PDL=True, num_warps=4, grid=(e,))
    ptx = kern.asm["ptx"]
    print(f"norm_route load_before_wait={ptx.index('ld.global') < ptx.index('griddepcontrol.wait')} "
          f"{ptxas_report(kern)}")


def select_experts():
    """The expert selection launch at Qwen3-Next's routing (512 experts, softmax top-10) with
    the entry of its stacked, gated shared expert, one token."""
    from blitzllm.kernels.moe import router as moe
    e, k = 512, 10
    logits = torch.zeros(1, e + 1)
    w, ids = torch.zeros(1, k + 1), torch.zeros(1, k + 1, dtype=torch.int32)
    kern = moe._select_experts_kernel.warmup(
        logits, logits, w, ids, logits.stride(0), 1.0, GROUP=e, N_GROUP=1, NG_PAD=1, G_PAD=e, TOPK_GROUP=1,
        TOP_K=k, K_PAD=16, SIGMOID=False, HAS_BIAS=False, RENORM=True, SHARED_GATE=True, USE_PDL=True,
        num_warps=1, grid=(1,))
    print(f"select_experts shared_gate=True: {ptxas_report(kern)}")


def fp8_weights():
    """weight_dtype='fp8' at Qwen3-30B-A3B sizes, one token, 128 x 128 blocks: the FP8 linear
    (o_proj) and the direct MoE gate/up and down GEMMs with float8 experts. One line each:
    name, the PTX's float8 -> wider conversions, ptxas report."""
    from blitzllm.kernels import fp8_weights as fw
    from blitzllm.kernels.moe import experts as fm
    bf, f8 = torch.bfloat16, torch.float8_e4m3fn
    e, h, inter, k, nh = 128, 2048, 768, 8, 4096
    x, y = torch.zeros(1, nh, dtype=bf), torch.zeros(1, h, dtype=bf)
    q, s = torch.zeros(h, nh, dtype=f8), torch.zeros(h // 128, nh // 128)
    kern = fw._fp8_linear_kernel.warmup(
        x, q, s, q, y, 1, h, nh, nh, nh, s.stride(0), h, BN_Q=128, BK_Q=128, BLOCK_M=16, BLOCK_N=16, BLOCK_K=128,
        EVEN_K=True, HAS_BIAS=False, IEEE=False, num_warps=4, num_stages=4, grid=(1, h // 16))
    print(f"fp8_linear {kern.asm['ptx'].count('cvt.rn.f16x2.e4m3x2')} {ptxas_report(kern)}")
    up, down = fm.moe_config(1, k, e, h, inter, bf, 132)
    xa, act = torch.zeros(1, h, dtype=bf), torch.zeros(k, inter, dtype=bf)
    w13, w2 = torch.zeros(e, 2 * inter, h, dtype=f8), torch.zeros(e, h, inter, dtype=f8)
    s13, s2 = torch.zeros(e, 2 * inter // 128, h // 128), torch.zeros(e, h // 128, inter // 128)
    ids = torch.zeros(k, dtype=torch.int32)
    for name, a, w, sc, out, n, kd, cfg, gated in (("fp8_moe_up", xa, w13, s13, act, inter, h, up, True),
                                                    ("fp8_moe_down", act, w2, s2, act, h, inter, down, False)):
        block_k = cfg["BLOCK_K"] if 128 % cfg["BLOCK_K"] == 0 else fw.fp8_block_k((128, 128))
        kern = fm._moe_gemm_kernel.warmup(
            a, w, out, ids, ids, ids, n, kd, k, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
            out, out, out, out.stride(0), ws_ptr=sc, stride_se=sc.stride(0), stride_sn=sc.stride(1), FP8=True,
            BN_Q=128, BK_Q=128, BLOCK_M=16, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, GATED=gated, EVEN_K=True,
            IEEE=False, USE_PDL=1, DIRECT=True, COMBINE=False, TOP_K=1, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"], grid=(k, triton.cdiv(n, cfg["BLOCK_N"])))
        print(f"{name} {kern.asm['ptx'].count('cvt.rn.f16x2.e4m3x2')} {ptxas_report(kern)}")


def _compiled(launch) -> list:
    """Run ``launch`` (a Triton launcher called on CPU tensors) with each of its kernel launches
    compiled for the active target instead of run: [(kernel name, compiled kernel), ...]."""
    from triton.runtime.jit import JITFunction
    got, orig = [], JITFunction.__getitem__

    def getitem(self, grid):
        def compile_only(*args, **kw):
            got.append((self.fn.__name__, self.warmup(*args, grid=grid, **kw)))
        return compile_only
    JITFunction.__getitem__ = getitem
    try:
        launch()
    finally:
        JITFunction.__getitem__ = orig
    return got


def kv_cache_fp8():
    """kv_cache_dtype='fp8' (float8 e4m3 caches, bf16 activations) at Qwen3-0.6B's heads and
    DeepSeek-V3's latents: every kernel that writes or reads the paged cache, through its launcher.
    One line each: launcher/kernel, the PTX's e4m3 conversions, ptxas report."""
    from blitzllm.kernels.attention import mla_decode, mla_prep, paged, qk_norm_rope_cache, sparse_mla
    bf, f8, i32 = torch.bfloat16, torch.float8_e4m3fn, torch.int32
    hq, hkv, d, bs, b = 16, 8, 128, 16, 2
    kc, vc = torch.zeros(8, bs, hkv, d, dtype=f8), torch.zeros(8, bs, hkv, d, dtype=f8)
    qkv, q = torch.zeros(b, (hq + 2 * hkv) * d, dtype=bf), torch.zeros(b, hq, d, dtype=bf)
    tables, lens, slots = torch.zeros(b, 4, dtype=i32), torch.full((b,), 40, dtype=i32), torch.zeros(b, dtype=torch.int64)
    pos, cs, w = torch.zeros(b, dtype=torch.int64), torch.zeros(64, d), torch.ones(d, dtype=bf)
    qsl = torch.tensor([0, 1, 2], dtype=i32)
    h, r, p = 16, 512, 64
    cache = torch.zeros(8, bs, 1, r + p, dtype=f8)
    ql, qr = torch.zeros(b, h, r, dtype=bf), torch.zeros(b, h, p, dtype=bf)
    launches = {
        "paged_decode": lambda: paged.paged_decode_attention_triton(q, kc, vc, tables, lens, 0.1),
        "fused_decode": lambda: paged.fused_decode_attention_triton(qkv, pos, cs, hq, hkv, d, kc, vc, slots, tables,
                                                                    lens, 0.1, w, w, 1e-6, d),
        "paged_prefill": lambda: paged.paged_prefill_attention_triton(q, kc, vc, qsl, lens, tables, 0.1, 1),
        "qk_norm_rope_cache": lambda: qk_norm_rope_cache.fused_qk_norm_rope_cache_triton(
            qkv, pos, cs, hq, hkv, d, kc, vc, slots, w, w),
        "mla_prep": lambda: mla_prep.mla_prep_triton(torch.zeros(b, h, 128 + p, dtype=bf),
                                                     torch.zeros(b, r + p, dtype=bf), pos, torch.zeros(64, p),
                                                     torch.ones(r, dtype=bf), 1e-6, cache, slots, 128),
        "mla_decode": lambda: mla_decode.mla_decode_triton(ql, qr, cache, tables, lens, 0.1),
        "sparse_mla": lambda: sparse_mla.sparse_mla_triton(ql, qr, cache, tables, torch.zeros(b, 64, dtype=i32), 0.1),
    }
    for name, launch in launches.items():
        for kname, kern in _compiled(launch):
            print(f"{name}/{kname}: {kern.asm['ptx'].count('e4m3x2')} {ptxas_report(kern)}")


def lora():
    """The LoRA shrink and expand kernels at Llama-3.1-8B's qkv (K 4096, N 6144, 3 slices) and
    down (K 14336, SiLU-and-mul input) sizes, rank 16, 4 slots, one row, bf16, with PDL."""
    from blitzllm.kernels.lora import lora as lk
    bf = torch.bfloat16
    slots = torch.zeros(1, dtype=torch.int64)
    for name, sr, k, n, silu in (("qkv", 48, 4096, 6144, False), ("down+silu", 16, 14336, 4096, True)):
        x, y = torch.zeros(1, 2 * k if silu else k, dtype=bf), torch.zeros(1, n, dtype=bf)
        a, b = torch.zeros(4, sr, k, dtype=bf), torch.zeros(4, sr, n, dtype=bf)
        part = torch.zeros(8, 1, sr)
        sr_pad = max(16, triton.next_power_of_2(sr))
        kern = lk._shrink_kernel.warmup(x, a, slots, part, k, sr, x.stride(0), a.stride(0), a.stride(1),
                                        part.stride(0), part.stride(1), 512, SILU_MUL=silu, SR_PAD=sr_pad,
                                        BLOCK_K=lk._BLOCK_K, USE_PDL=True, num_warps=4, grid=(1, 8))
        print(f"lora shrink {name}: pdl={'griddepcontrol.wait' in kern.asm['ptx']} {ptxas_report(kern)}")
        if not silu:
            kern = lk._expand_kernel.warmup(y, part, b, slots, n, sr, 8, y.stride(0), part.stride(0),
                                            part.stride(1), b.stride(0), b.stride(1), SR_PAD=sr_pad,
                                            SPLITS_PAD=8, BLOCK_N=lk._BLOCK_N, USE_PDL=True, num_warps=4,
                                            grid=(1, n // lk._BLOCK_N))
            print(f"lora expand {name}: pdl={'griddepcontrol.wait' in kern.asm['ptx']} {ptxas_report(kern)}")


if __name__ == "__main__":
    drv.set_active(_Sm90())
    decode_attention()
    gemv()
    moe_direct()
    norm_route()
    select_experts()
    kv_cache_fp8()
    fp8_weights()
    lora()
