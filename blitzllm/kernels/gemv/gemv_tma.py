"""Decode GEMV ``out[m] = W @ x[m]`` (1-2 rows) whose weights stream by Hopper's bulk tensor copy
(TMA) into shared memory before the PDL wait: the Gluon kernel (Hopper only, no interpreter
path), its heuristic and ``reference_gemv_tma``. Which projections take it
is the decode plan's (docs/gpu-performance.md#the-tma-gemv-o_proj-qkv).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .._common import HAS_TRITON, capability, device_sms, next_pow2, pdl_enabled, triton
from .gemv import reference_linear

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAS_GLUON = HAS_TRITON
except Exception:  # pragma: no cover - depends on the Triton build
    HAS_GLUON = False

# Which projections take this GEMV is the runner's decode plan (knob BLITZ_GEMV_TMA).
# shared memory per program for W's ring: where a program's whole weight slice fits, all of it
# is in flight before the wait; the rest of sm_90's 227 KB holds x
TMA_SMEM_BYTES = 160 << 10
TMA_MAX_ROWS = 2
_BLOCK_NS = (8, 16)  # the row-tile sizes the heuristic picks from
TMA_WARPS = 8  # warps per program at most (over a tile's rows)
TMA_GROUP_BYTES = 32 << 10  # bytes per copy at most

if HAS_GLUON:
    @gluon.jit
    def _gdc_wait():
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _gdc_launch_dependents():
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.constexpr_function
    def _pow2(n):
        return 1 << (n - 1).bit_length()

    @gluon.jit
    def _issue(w_desc, smem, bars, q, total, pid, nprog, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
               G: gl.constexpr, GPT: gl.constexpr, SLOTS: gl.constexpr, GROUPED: gl.constexpr):
        """Copy group q of this program's sequence (tile q // GPT; its K chunks
        (q % GPT) * G ... + G) into slot q % SLOTS, completing on that slot's barrier (nothing
        where q >= total)."""
        ok = q < total
        s = q % SLOTS
        row = (pid + (q // GPT) * nprog) * BLOCK_N
        bar = bars.index(s)
        mbarrier.expect(bar, w_desc.block_type.nbytes, pred=ok)
        if GROUPED:  # W viewed as [K / BLOCK_K, N, BLOCK_K]: G chunks in one copy
            tma.async_copy_global_to_shared(w_desc, [(q % GPT) * G, row, 0], bar, smem.index(s), pred=ok)
        else:  # W as [1, N, K]: one chunk per copy (K not a multiple of BLOCK_K)
            tma.async_copy_global_to_shared(w_desc, [0, row, (q % GPT) * BLOCK_K], bar, smem.index(s), pred=ok)

    @gluon.jit
    def _gemv_tma_kernel(w_desc, x_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_om, n_tiles,
                         BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, CHUNKS: gl.constexpr, G: gl.constexpr,
                         SLOTS: gl.constexpr, GROUPED: gl.constexpr, TWO_ROWS: gl.constexpr,
                         HAS_BIAS: gl.constexpr, USE_PDL: gl.constexpr, TPW_K: gl.constexpr,
                         WN: gl.constexpr):
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        GPT: gl.constexpr = CHUNKS // G  # copies (groups of G chunks) per tile
        total = (n_tiles - pid + nprog - 1) // nprog * GPT  # this program's groups
        smem = gl.allocate_shared_memory(w_desc.dtype, [SLOTS, G, BLOCK_N, BLOCK_K], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(SLOTS):
            mbarrier.init(bars.index(s), count=1)
        for i in gl.static_range(SLOTS):  # the preload: in flight before the wait
            _issue(w_desc, smem, bars, i, total, pid, nprog, BLOCK_N, BLOCK_K, G, GPT, SLOTS, GROUPED)
        ROWS: gl.constexpr = 2 if TWO_ROWS else 1
        XR: gl.constexpr = _pow2(ROWS * CHUNKS)  # x as [XR, BLOCK_K] (shapes are powers of two)
        xs = gl.allocate_shared_memory(w_desc.dtype, [XR, BLOCK_K], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        # a group [G, BLOCK_N, BLOCK_K]: each thread holds 16-byte runs along K of all G chunks
        # (their sum stays in the thread), lanes along K, warps over the rows
        L3: gl.constexpr = gl.BlockedLayout([G, 1, 8], [1, 32 // TPW_K, TPW_K], [1, WN, 1], [2, 1, 0])
        L2: gl.constexpr = gl.SliceLayout(0, L3)
        XL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_K, TPW_K], [WN, 1], [1, 0])
        YL: gl.constexpr = gl.SliceLayout(1, L2)
        offs_n = gl.arange(0, BLOCK_N, layout=YL)
        xi = gl.expand_dims(gl.arange(0, XR, layout=gl.SliceLayout(1, XL)), 1)  # chunk row r * CHUNKS + c
        xk = gl.expand_dims(gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, XL)), 0)
        xr = xi // CHUNKS
        xk = (xi % CHUNKS) * BLOCK_K + xk
        dt = out_ptr.dtype.element_ty
        if USE_PDL:
            _gdc_wait()
            _gdc_launch_dependents()
        # x, the only input from the kernel before: one load of all of it (every round trip in
        # flight at once), kept in shared memory for all tiles
        xmask = (xi < ROWS * CHUNKS) & (xk < K) & (xr < M)
        xv = gl.load(x_ptr + xr * stride_xm + xk, mask=xmask, other=0.0)
        xs.store(xv)
        gl.thread_barrier()
        # Where one copy holds a whole row tile (all of K: qkv's 8 x 2048 tiles) every tile takes
        # the same x chunks: they are widened to fp32 once, here, instead of reloaded and widened
        # per tile (fewer instructions per tile in the loop, at the cost of registers)
        HOIST: gl.constexpr = GPT == 1
        if HOIST:
            x0h = gl.expand_dims(xs.slice(0, G).load(gl.SliceLayout(1, L3)).to(gl.float32), 1)
            if TWO_ROWS:
                x1h = gl.expand_dims(xs.slice(CHUNKS, G).load(gl.SliceLayout(1, L3)).to(gl.float32), 1)
        for t in range(0, total // GPT):
            acc0 = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, L2)
            acc1 = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, L2)
            for gi in gl.static_range(GPT):
                q = t * GPT + gi
                mbarrier.wait(bars.index(q % SLOTS), (q // SLOTS) & 1)
                w = smem.index(q % SLOTS).load(L3).to(gl.float32)
                if HOIST:
                    acc0 += gl.sum(w * x0h, axis=0)
                    if TWO_ROWS:
                        acc1 += gl.sum(w * x1h, axis=0)
                else:
                    x0 = xs.slice(gi * G, G).load(gl.SliceLayout(1, L3)).to(gl.float32)
                    acc0 += gl.sum(w * gl.expand_dims(x0, 1), axis=0)
                    if TWO_ROWS:
                        x1 = xs.slice(CHUNKS + gi * G, G).load(gl.SliceLayout(1, L3)).to(gl.float32)
                        acc1 += gl.sum(w * gl.expand_dims(x1, 1), axis=0)
                if SLOTS < total:  # the ring turns: refill this slot once every warp has read it
                    gl.thread_barrier()
                    fence_async_shared()
                    _issue(w_desc, smem, bars, q + SLOTS, total, pid, nprog, BLOCK_N, BLOCK_K, G, GPT, SLOTS,
                           GROUPED)
            rows = (pid + t * nprog) * BLOCK_N + offs_n
            n_ok = rows < N
            y0 = gl.sum(acc0, axis=1)
            if HAS_BIAS:
                bias = gl.load(b_ptr + rows, mask=n_ok, other=0.0).to(gl.float32)
                y0 += bias
            gl.store(out_ptr + rows, y0.to(dt), mask=n_ok)
            if TWO_ROWS:
                y1 = gl.sum(acc1, axis=1)
                if HAS_BIAS:
                    y1 += bias
                gl.store(out_ptr + stride_om + rows, y1.to(dt), mask=n_ok & (M > 1))
        for s in gl.static_range(SLOTS):
            mbarrier.invalidate(bars.index(s))


def tma_gemv_config(N: int, K: int, itemsize: int, sms: int, smem_bytes: int = TMA_SMEM_BYTES,
                    warps: int = None, group_bytes: int = None) -> dict:
    """BLOCK_N (the row-tile size that spreads W most evenly over at most one program per SM),
    BLOCK_K (256 values, a TMA box row), G (chunks per copy: up to ``group_bytes``, where BLOCK_K
    divides K), programs, SLOTS (a program's copies, capped by ``smem_bytes``) and the warps (WN,
    over the rows; a copy's chunks stay within each thread)."""
    warps = warps or TMA_WARPS
    group_bytes = group_bytes or TMA_GROUP_BYTES
    bk = min(256, max(16 // itemsize, next_pow2(K)))
    chunks = triton.cdiv(K, bk)
    best = None
    for bn in _BLOCK_NS:
        tiles = triton.cdiv(N, bn)
        progs = min(tiles, sms)
        per_prog = triton.cdiv(tiles, progs) * bn * chunks * bk * itemsize  # the busiest program's bytes
        key = (per_prog, -bn)
        if best is None or key < best[0]:
            best = (key, bn, tiles, progs)
    _, bn, tiles, progs = best
    g = 1
    if K % bk == 0:
        while chunks % (2 * g) == 0 and 2 * g * bn * bk * itemsize <= group_bytes:
            g *= 2
    wn = min(warps, bn)  # warps over the rows (more warps than rows would repeat the work)
    copy_bytes = g * bn * bk * itemsize
    my_copies = triton.cdiv(tiles, progs) * (chunks // g)
    slots = max(2, min(my_copies, smem_bytes // copy_bytes))
    return {"BLOCK_N": bn, "BLOCK_K": bk, "CHUNKS": chunks, "G": g, "SLOTS": slots, "programs": progs,
            "tiles": tiles, "WN": wn, "num_warps": wn}


@functools.lru_cache(maxsize=256)
def _cached_config(N, K, itemsize, sms, smem_bytes):
    return tma_gemv_config(N, K, itemsize, sms, smem_bytes)


def tma_gemv_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``gemv_tma_triton(x, w)`` runs here: Hopper with PDL, 1-2 rows, a contiguous
    bf16/fp16 W whose rows are 16-byte aligned (the TMA's rule), x of W's dtype."""
    if not HAS_GLUON or not (x.is_cuda and w.is_cuda) or not pdl_enabled(w):
        return False
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    return (capability(w)[0] == 9 and 1 <= rows <= TMA_MAX_ROWS and w.dim() == 2 and w.dtype in (torch.bfloat16, torch.float16)
            and x.dtype == w.dtype and w.is_contiguous() and w.data_ptr() % 16 == 0
            and (w.shape[1] * w.element_size()) % 16 == 0 and w.shape[0] > 0)


def gemv_tma_triton(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                    out: Optional[torch.Tensor] = None, config: Optional[dict] = None) -> torch.Tensor:
    """x [M <= 2, K], w [N, K] -> [M, N] in x's dtype (``config``: tma_gemv_config's keys, for
    tests and benchmarks)."""
    assert HAS_GLUON and x.is_cuda, "the TMA GEMV needs a Hopper GPU and Gluon"
    M, K = x.shape
    N = w.shape[0]
    assert 1 <= M <= TMA_MAX_ROWS and w.shape[1] == K and x.dtype == w.dtype, (tuple(x.shape), tuple(w.shape))
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _launch(x, w, bias, out, config)
    return out


def _launch(x, w, bias, out, config) -> None:
    M, K = x.shape
    N = w.shape[0]
    cfg = config or _cached_config(N, K, w.element_size(), device_sms(x), TMA_SMEM_BYTES)
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    grouped = K % bk == 0
    desc = _descriptor(w, bn, bk, cfg["G"], grouped)
    pdl = pdl_enabled(x)
    kw = {"launch_pdl": True} if pdl else {}
    _gemv_tma_kernel[(cfg["programs"],)](
        desc, x, bias if bias is not None else out, out, M, N, K, x.stride(0), out.stride(0), cfg["tiles"],
        BLOCK_N=bn, BLOCK_K=bk, CHUNKS=cfg["CHUNKS"], G=cfg["G"], SLOTS=cfg["SLOTS"], GROUPED=grouped,
        TWO_ROWS=M > 1, HAS_BIAS=bias is not None, USE_PDL=pdl, TPW_K=min(32, bk // 8), WN=cfg["WN"],
        num_warps=cfg["num_warps"], **kw)


def _descriptor(w: torch.Tensor, bn: int, bk: int, g: int, grouped: bool):
    """W's TMA descriptor, 3-D, no swizzle (the program reads whole 16-byte runs along K, so
    rows of 512 bytes meet no bank conflicts): grouped (BLOCK_K divides K), W as
    [K / bk, N, bk] and [g, bn, bk] boxes, g chunks of a row tile per copy; otherwise W as
    [1, N, K] and [1, bn, bk] boxes (the copy zero-fills past K)."""
    N, K = w.shape
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * w.element_size(), rank=3)
    if grouped:
        return TensorDescriptor(w, [K // bk, N, bk], [bk, K, 1], [g, bn, bk], layout)
    return TensorDescriptor(w, [1, N, K], [N * K, K, 1], [1, bn, bk], layout)


def reference_gemv_tma(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The torch form: fp32 products and sums, the output rounded once to x's dtype."""
    return reference_linear(x, w, bias)
