"""Decode o_proj that merges the split-K decode attention's partials itself (Hopper, Gluon).

By default the split of the decode attention that finishes last for a (sequence, KV head)
merges every split's partials: an arrival counter, then an L2 read of the partials, on
every layer's critical path between the attention and o_proj. Here the attention leaves
its partials unmerged (``paged_attention.DecodePartials``) and o_proj merges them. The
projection is split along K by query head: program (head h, row block r) holds o_proj's
columns of head h (D values) for its rows. As in ``gemv_tma.py`` the program issues the
bulk tensor copies (TMA) of its whole weight slice into shared memory before its PDL wait,
so they stream while the attention runs; after the wait it merges head h's partials for
each row (the active splits: a few KB from L2, one round trip), rounds the head's output
to the weights' dtype (as the attention's output is), multiplies its rows, and adds the
products into the fp32 output with atomics. The attention launch zeroes that output
(``paged_decode_attention_triton(zero=)``); the next residual add + RMSNorm rounds the fp32
sum to the residual's dtype (``rmsnorm.fused_add_rms_norm``, ``moe.norm_router_logits``),
as it would round o_proj's own fp32 accumulation. The summation order over heads is not
fixed, so the rounded sum may differ in its last bit from run to run.

Written in Gluon: no interpreter path. ``reference_oproj_partials`` is the torch form;
``tests/kernels/test_kernel_oproj_partials.py`` compiles the kernel for sm_90 on any
machine and checks it against the reference on a GPU.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from ._common import capability, device_sms, next_pow2, pdl_enabled
from .gemv_tma import HAS_GLUON
from .paged_attention import DecodePartials, merge_decode_partials

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from .gemv_tma import _gdc_launch_dependents, _gdc_wait

# BLITZ_ATTN_OPROJ=1 (opt-in until measured on a GPU): decode layers whose o_proj follows the
# fused decode attention take this path (``DecoderAttention.attend_project``)
OPROJ_PARTIALS = os.environ.get("BLITZ_ATTN_OPROJ", "0")
if OPROJ_PARTIALS not in ("0", "1"):
    raise ValueError(f"BLITZ_ATTN_OPROJ must be 0 or 1, got {OPROJ_PARTIALS!r}")
OPROJ_PARTIALS = OPROJ_PARTIALS == "1"
PARTIALS_SMEM_BYTES = int(os.environ.get("BLITZ_ATTN_OPROJ_SMEM", str(160 << 10)))  # per program
COPY_BYTES = 32 << 10  # bytes per copy at most
MAX_ROWS = 2  # decode rows (sequences) per launch

if HAS_GLUON:
    @gluon.jit
    def _issue_head(w_desc, smem, bars, t, n_tiles, h, row0, BLOCK_N: gl.constexpr, SLOTS: gl.constexpr):
        """Copy tile t of this program (rows row0 + t * BLOCK_N.., head h's D columns) into slot
        t % SLOTS, completing on that slot's barrier (nothing where t >= n_tiles)."""
        ok = t < n_tiles
        s = t % SLOTS
        bar = bars.index(s)
        mbarrier.expect(bar, w_desc.block_type.nbytes, pred=ok)
        tma.async_copy_global_to_shared(w_desc, [h, row0 + t * BLOCK_N, 0], bar, smem.index(s), pred=ok)

    @gluon.jit
    def _active(seq_len, NUM_SPLITS: gl.constexpr, KV_BN: gl.constexpr):
        """``paged_attention.active_splits``: the splits holding a context of seq_len keys."""
        n_tiles = (seq_len + KV_BN - 1) // KV_BN
        per = gl.maximum((n_tiles + NUM_SPLITS - 1) // NUM_SPLITS, 1)
        return gl.maximum((n_tiles + per - 1) // per, 1)

    @gluon.jit
    def _merge_head(m_ptr, l_ptr, acc_ptr, row, n_active, offs_s, offs_d, D: gl.constexpr):
        """One head's merged attention output [D] (fp32) from its partial rows
        row .. row + n_active (``merge_decode_partials``' formula)."""
        ok = offs_s < n_active
        m = gl.load(m_ptr + row + offs_s, mask=ok, other=-1.0e30, cache_modifier=".cg")
        l_s = gl.load(l_ptr + row + offs_s, mask=ok, other=0.0, cache_modifier=".cg")
        a = gl.load(acc_ptr + gl.expand_dims((row + offs_s) * D, 1) + gl.expand_dims(offs_d, 0),
                    mask=gl.expand_dims(ok, 1), other=0.0, cache_modifier=".cg")
        w = gl.exp2(m - gl.max(m, axis=0))
        total = gl.sum(w * l_s, axis=0)
        o = gl.sum(a * gl.expand_dims(w, 1), axis=0)
        return o / gl.where(total > 0.0, total, 1.0)

    @gluon.jit
    def _oproj_partials_kernel(w_desc, m_ptr, l_ptr, acc_ptr, seq_ptr, b_ptr, out_ptr, M, N, Hq, stride_om,
                               NUM_SPLITS: gl.constexpr, S_PAD: gl.constexpr, D: gl.constexpr,
                               KV_BN: gl.constexpr, BLOCK_N: gl.constexpr, TILES: gl.constexpr,
                               SLOTS: gl.constexpr, TWO_ROWS: gl.constexpr, HAS_BIAS: gl.constexpr,
                               USE_PDL: gl.constexpr, TPW_K: gl.constexpr, TPW_S: gl.constexpr,
                               WN: gl.constexpr):
        pid = gl.program_id(0)
        h = pid % Hq
        row0 = (pid // Hq) * (TILES * BLOCK_N)
        n_tiles = gl.minimum((N - row0 + BLOCK_N - 1) // BLOCK_N, TILES)
        smem = gl.allocate_shared_memory(w_desc.dtype, [SLOTS, 1, BLOCK_N, D], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(SLOTS):
            mbarrier.init(bars.index(i), count=1)
        for i in gl.static_range(SLOTS):  # the preload: in flight before the wait
            _issue_head(w_desc, smem, bars, i, n_tiles, h, row0, BLOCK_N, SLOTS)
        # partials [S_PAD, D]: 16-byte runs along D per thread, warps over the splits; a W copy
        # [1, BLOCK_N, D] as gemv_tma.py's: 16-byte runs along D per thread, lanes along D, warps
        # over the rows
        LS: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TPW_S, TPW_S], [WN, 1], [1, 0])
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32 // TPW_K, TPW_K], [1, WN, 1], [2, 1, 0])
        XL: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, L3))  # a head's D values, broadcast over rows
        offs_s = gl.arange(0, S_PAD, layout=gl.SliceLayout(1, LS))
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, LS))
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(0, L3)))
        # the split schedule needs only the context lengths (host inputs, ready before the step)
        act0 = _active(gl.load(seq_ptr), NUM_SPLITS, KV_BN)
        if TWO_ROWS:
            act1 = _active(gl.load(seq_ptr + 1), NUM_SPLITS, KV_BN)
        if USE_PDL:
            _gdc_wait()
            _gdc_launch_dependents()
        dt = w_desc.dtype
        x0 = _merge_head(m_ptr, l_ptr, acc_ptr, h * NUM_SPLITS, act0, offs_s, offs_d, D)
        x0 = gl.expand_dims(gl.expand_dims(gl.convert_layout(x0.to(dt).to(gl.float32), XL), 0), 1)  # [1, 1, D]
        if TWO_ROWS:
            x1 = _merge_head(m_ptr, l_ptr, acc_ptr, (Hq + h) * NUM_SPLITS, act1, offs_s, offs_d, D)
            x1 = gl.expand_dims(gl.expand_dims(gl.convert_layout(x1.to(dt).to(gl.float32), XL), 0), 1)
        for t in range(0, n_tiles):
            slot = t % SLOTS
            mbarrier.wait(bars.index(slot), (t // SLOTS) & 1)
            w = smem.index(slot).load(L3).to(gl.float32)  # [1, BLOCK_N, D]
            y0 = gl.sum(gl.sum(w * x0, axis=0), axis=1)
            if TWO_ROWS:
                y1 = gl.sum(gl.sum(w * x1, axis=0), axis=1)
            if SLOTS < TILES:  # the ring turns: refill this slot once every warp has read it
                gl.thread_barrier()
                fence_async_shared()
                _issue_head(w_desc, smem, bars, t + SLOTS, n_tiles, h, row0, BLOCK_N, SLOTS)
            rows = row0 + t * BLOCK_N + offs_n
            n_ok = rows < N
            if HAS_BIAS:  # (head 0's programs add it)
                bias = gl.load(b_ptr + rows, mask=n_ok & (h == 0), other=0.0).to(gl.float32)
                y0 += bias
            gl.atomic_add(out_ptr + rows, y0, mask=n_ok, sem="relaxed")
            if TWO_ROWS:
                if HAS_BIAS:
                    y1 += bias
                gl.atomic_add(out_ptr + stride_om + rows, y1, mask=n_ok & (M > 1), sem="relaxed")
        for i in gl.static_range(SLOTS):
            mbarrier.invalidate(bars.index(i))


def oproj_partials_config(N: int, num_heads: int, head_dim: int, itemsize: int, sms: int,
                          smem_bytes: int = PARTIALS_SMEM_BYTES) -> Optional[dict]:
    """Tiles of the head-split o_proj (None where it does not apply: more heads than SMs, a
    head_dim that is not a power of two in [16, 256]): as many row blocks per head as keep
    every program on an SM of its own, BLOCK_N rows per copy (up to ``COPY_BYTES``), TILES copies
    per program, SLOTS of them in shared memory (all where ``smem_bytes`` holds them). E.g.
    H200, bf16, Qwen3-30B-A3B (2048 x 32 heads of 128): 128 programs of 512 rows, four 32 KB
    copies each, all preloaded."""
    d = head_dim
    if num_heads > sms or d != next_pow2(d) or not 16 <= d <= 256 or N <= 0:
        return None
    blocks = max(1, sms // num_heads)
    bn = 256
    while bn > 8 and bn * d * itemsize > COPY_BYTES:
        bn //= 2
    rows = -(-N // blocks)
    bn = min(bn, max(8, next_pow2(rows)))
    tiles = -(-rows // bn)
    blocks = -(-N // (tiles * bn))
    copy = bn * d * itemsize
    slots = max(1, min(tiles, smem_bytes // copy))
    warps = min(8, max(1, bn // max(1, 32 // min(32, d // 8))))
    return {"BLOCK_N": bn, "TILES": tiles, "SLOTS": slots, "blocks": blocks, "programs": blocks * num_heads,
            "WN": warps, "num_warps": warps}


@functools.lru_cache(maxsize=64)
def _cached_config(N, num_heads, head_dim, itemsize, sms, smem_bytes):
    return oproj_partials_config(N, num_heads, head_dim, itemsize, sms, smem_bytes)


def oproj_partials_wanted() -> bool:
    """BLITZ_ATTN_OPROJ=1: models mark their plain single-rank o_proj for this path."""
    return OPROJ_PARTIALS


def oproj_partials_ok(x: torch.Tensor, w: torch.Tensor, num_heads: int, head_dim: int) -> bool:
    """Whether ``oproj_partials_triton`` runs o_proj ``w`` [N, Hq * D] for the decode rows of
    ``x`` (the qkv projection output, [rows, ...]): BLITZ_ATTN_OPROJ=1, Hopper with PDL and
    Gluon, 1-2 rows, a contiguous bf16/fp16 W of x's dtype, a config for its shape."""
    if not OPROJ_PARTIALS or not HAS_GLUON or not (x.is_cuda and w.is_cuda) or not pdl_enabled(w):
        return False
    rows = x.shape[0] if x.dim() == 2 else 0
    return (capability(w)[0] == 9 and 1 <= rows <= MAX_ROWS and w.dim() == 2
            and w.dtype in (torch.bfloat16, torch.float16) and x.dtype == w.dtype and w.is_contiguous()
            and w.shape[1] == num_heads * head_dim and w.data_ptr() % 16 == 0
            and _cached_config(w.shape[0], num_heads, head_dim, w.element_size(), device_sms(w),
                               PARTIALS_SMEM_BYTES) is not None)


def oproj_partials_triton(p: DecodePartials, w: torch.Tensor, out: torch.Tensor,
                          bias: Optional[torch.Tensor] = None, config: Optional[dict] = None) -> torch.Tensor:
    """out [M, N] fp32 (zeroed by the attention launch that made ``p``) += W @ merge(p) per row:
    o_proj of the merged attention output, its heads' products added with atomics."""
    assert HAS_GLUON and w.is_cuda, "the head-split o_proj needs a Hopper GPU and Gluon"
    M, hq, s = p.m.shape
    d = p.acc.shape[-1]
    N = w.shape[0]
    assert 1 <= M <= MAX_ROWS and w.shape[1] == hq * d and p.dtype == w.dtype
    assert out.shape == (M, N) and out.dtype == torch.float32 and out.stride(1) == 1
    cfg = config or _cached_config(N, hq, d, w.element_size(), device_sms(w), PARTIALS_SMEM_BYTES)
    assert cfg is not None, f"no head-split o_proj for {N} rows x {hq} heads of {d}"
    bn = cfg["BLOCK_N"]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * w.element_size(), rank=3)
    desc = TensorDescriptor(w, [hq, N, d], [d, hq * d, 1], [1, bn, d], layout)  # W as [head, row, D]
    pdl = pdl_enabled(w)
    kw = {"launch_pdl": True} if pdl else {}
    _oproj_partials_kernel[(cfg["programs"],)](
        desc, p.m, p.l, p.acc, p.seq_lens, bias if bias is not None else out, out, M, N, hq, out.stride(0),
        NUM_SPLITS=s, S_PAD=next_pow2(s), D=d, KV_BN=p.block_n, BLOCK_N=bn, TILES=cfg["TILES"],
        SLOTS=cfg["SLOTS"], TWO_ROWS=M > 1, HAS_BIAS=bias is not None, USE_PDL=pdl,
        TPW_K=min(32, d // 8), TPW_S=min(32, d // 4), WN=cfg["WN"], num_warps=cfg["num_warps"], **kw)
    return out


def reference_oproj_partials(p: DecodePartials, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The torch form: merge the partials (rounded to p.dtype, as the attention's output),
    then o_proj in fp32 -> [M, N] fp32, not rounded."""
    x = merge_decode_partials(p, p.acc.shape[-1]).flatten(1).float()
    y = x @ w.float().t()
    return y if bias is None else y + bias.float()
