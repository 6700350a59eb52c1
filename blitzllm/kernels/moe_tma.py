"""Decode MoE experts in one launch whose weights stream through Hopper's bulk tensor copy
(TMA) into shared memory: gate/up, SiLU-and-mul, a grid-wide handoff, down and the
weighted combine, for 1-2 tokens.

``out[t] = sum_k w[t, k] * round(down_e(round(silu(round(gate_e x_t))) * round(up_e x_t)))``
with e = ids[t, k], the numerics of ``moe.reference_fused_moe``.

Why one launch: at batch 1 the two grouped GEMMs of the direct path (``fused_moe.py``)
each ramp up and drain, the gate/up one on only (chosen experts x n-tiles) programs, and
the down launch cannot start its weight stream before gate/up ends. Here every SM runs one
program (persistent) and streams a fixed share of *both* weight sets through one ring of
shared-memory slots: its gate/up tiles first, then its down tiles. The down copies are
issued as the gate/up slots free up (the chosen experts are known from the start), so
the weight stream does not pause at the handoff; a program only waits (an arrival counter
in global memory) before it *multiplies* by the intermediate activations, which every
program must have written first. All programs are resident at once (one per SM at most,
nothing launched after this kernel takes an SM before each program has started), so the
wait cannot deadlock.

Work split: copies of up to 32 KB ([G, BLOCK_N, BLOCK_K] slots: G chunks of BLOCK_K along K
of BLOCK_N rows, from a 3-D view [K / BLOCK_K, rows, BLOCK_K] of the weights; a copy never
reaches past a row's end, so where a row's chunks are not a multiple of G a copy fills fewer):
- gate/up tile (entry s = (token, k), rows [r, r + BLOCK_N) of the intermediate): the gate
  rows and the up rows over all of H -> act[s, r:r+BLOCK_N] (to global memory, L2);
- down tile (entry s, rows [n, n + BLOCK_N) of the output): that expert's rows over all of I,
  rounded -> y[s, n:n+BLOCK_N]; per (token, row block) the program whose tile arrives last
  (an arrival counter) sums the TOP_K outputs weighted, in k order (deterministic).
Each program takes a contiguous range of the gate/up tiles and of the down tiles, so its
copies come from one or two experts. The first form of this kernel, whose down tiles took
every chosen expert's rows of a row block (a copy stream changing expert at every copy), ran
its down phase at 1.3-1.9 TB/s on the H200 with all programs ending at the same moment, as
if each new expert stalled a program's copies.

Opt-in (BLITZ_MOE_TMA=1): on the H200 it matches the two launches alone but measured slower
end to end (the switch's comment has the figures).

Written in Gluon (explicit shared memory, mbarriers, TMA), Hopper only: no interpreter
path; ``reference_moe_tma`` is the torch form (``moe.reference_fused_moe``), and
``tests/kernels/test_kernel_moe_tma.py`` compiles the kernel for sm_90 on any machine and
checks it against the reference on a GPU.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from ._common import capability, device_sms, next_pow2, pdl_enabled, triton
from .fused_moe import _counters  # zeroed int32 counters per device, left 0 by each launch
from .gemv_tma import HAS_GLUON

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from .gemv_tma import _gdc_launch_dependents, _gdc_wait, _pow2, _stamp

# BLITZ_MOE_TMA=1 (opt-in, Hopper): decode MoE layers of 1-2 tokens take this launch instead
# of the direct path's two grouped GEMMs. Off by default: on the H200 it matches the two launches
# alone (scripts/bench_moe_tma.py, CUDA graphs, us per layer: qwen3-30b-a3b 27.20 vs 27.28,
# minimax-m2 65.72 vs 67.09, deepseek-v3 166.26 vs 167.55) but end to end qwen3-30b-a3b batch 1
# measured 376.2 vs 409.5 tok/s: the kernels after it lose their overlap (its programs hold
# 217 KB of shared memory each, so the next layer's qkv GEMV cannot start its preload beside them)
MOE_TMA = os.environ.get("BLITZ_MOE_TMA", "0")
if MOE_TMA not in ("0", "1"):
    raise ValueError(f"BLITZ_MOE_TMA must be 0 or 1, got {MOE_TMA!r}")
MOE_TMA_MAX_TOKENS = 2
MOE_TMA_SMEM = int(os.environ.get("BLITZ_MOE_TMA_SMEM", str(216 << 10)))  # per program, all buffers
MOE_TMA_COPY_BYTES = 32 << 10
MOE_TMA_DOWN_COPY_BYTES = 16 << 10
MOE_TMA_BLOCK_K = 256
MOE_TMA_WARPS = 8
# BLITZ_MOE_TMA_DOWN=1: the direct path's down GEMM (1-2 tokens, Hopper) runs as this kernel's
# down phase alone (``moe_tma_down_triton``): the gate/up launch lets it launch as soon as the
# routing is known, so its programs issue their weight copies before their PDL wait, on the SMs
# the gate/up launch leaves free at once and on the others as its programs end
# (=late, A/B: the gate/up launch lets it launch only after its main loop, as for the direct down)
_TMA_DOWN_MODE = os.environ.get("BLITZ_MOE_TMA_DOWN", "0")
if _TMA_DOWN_MODE not in ("0", "1", "late"):
    raise ValueError(f"BLITZ_MOE_TMA_DOWN must be 0, 1 or late, got {_TMA_DOWN_MODE!r}")
MOE_TMA_DOWN = _TMA_DOWN_MODE != "0"
MOE_TMA_DOWN_EARLY = _TMA_DOWN_MODE == "1"
# BLITZ_MOE_TMA_DEPS=early (A/B): the kernels after it launch at the handoff, not as its programs
# end (qwen3-30b-a3b batch 1: 368.8 vs 376.2 tok/s)
MOE_TMA_LATE_DEPS = os.environ.get("BLITZ_MOE_TMA_DEPS", "late") != "early"

if HAS_GLUON:
    @gluon.jit
    def _pick(vec, lanes, i):
        """vec[i] of a small vector every thread holds whole (no shuffles)."""
        return gl.sum(gl.where(lanes == i, vec, gl.zeros_like(vec)), axis=0)

    @gluon.jit
    def _issue(w13_desc, w2_desc, smem, bars, c, gu_total, total, g0, d0, idv, lanes, H, I,
               BLOCK_N: gl.constexpr, G: gl.constexpr, GG: gl.constexpr, GD: gl.constexpr, GGB: gl.constexpr,
               GDB: gl.constexpr, GUC: gl.constexpr, DNC: gl.constexpr, SLOTS: gl.constexpr):
        """Copy c of this program's sequence into slot c % SLOTS (nothing where c >= total):
        copies [0, gu_total) are its gate/up tiles g0, g0 + 1, ... (gate part, then up part,
        GUC copies of GG chunks each), the rest its down tiles d0, d0 + 1, ... (DNC copies of GD
        chunks each). A copy of fewer than G chunks fills the slot's first ones (no reads past a
        row's end), as boxes of GGB / GDB chunks (TMA boxes here are powers of two) on the slot's
        barrier."""
        ok = c < total
        s_slot = c % SLOTS
        bar = bars.index(s_slot)
        if c < gu_total:
            rb_i = I // BLOCK_N
            r = c % (2 * GUC)
            tile = g0 + c // (2 * GUC)
            e = _pick(idv, lanes, tile // rb_i)
            row = e * (2 * I) + (r // GUC) * I + (tile % rb_i) * BLOCK_N
            mbarrier.expect(bar, w13_desc.block_type.nbytes * (GG // GGB), pred=ok)
            for j in gl.static_range(GG // GGB):  # boxes of GGB chunks (a power of two)
                tma.async_copy_global_to_shared(w13_desc, [(r % GUC) * GG + j * GGB, row, 0], bar,
                                                smem.index(s_slot).slice(j * GGB, GGB), pred=ok)
        else:
            rb_h = H // BLOCK_N
            c2 = c - gu_total
            tile = d0 + c2 // DNC
            e = _pick(idv, lanes, tile // rb_h)
            row = e * H + (tile % rb_h) * BLOCK_N
            mbarrier.expect(bar, w2_desc.block_type.nbytes * (GD // GDB), pred=ok)
            for j in gl.static_range(GD // GDB):
                tma.async_copy_global_to_shared(w2_desc, [(c2 % DNC) * GD + j * GDB, row, 0], bar,
                                                smem.index(s_slot).slice(j * GDB, GDB), pred=ok)

    @gluon.jit
    def _consume(w13_desc, w2_desc, smem, bars, c, acc, vs, gu_total, total, g0, d0, idv, lanes, H, I,
                 L3: gl.constexpr, BLOCK_N: gl.constexpr, G: gl.constexpr, GG: gl.constexpr, GD: gl.constexpr,
                 GGB: gl.constexpr, GDB: gl.constexpr, GUC: gl.constexpr, DNC: gl.constexpr, SLOTS: gl.constexpr):
        """acc += copy c times its G input chunks vs (shared memory [G, BLOCK_K]), then the
        slot refills with copy c + SLOTS once every warp has read it."""
        mbarrier.wait(bars.index(c % SLOTS), (c // SLOTS) & 1)
        w = smem.index(c % SLOTS).load(L3).to(gl.float32)
        v = vs.load(gl.SliceLayout(1, L3)).to(gl.float32)
        acc += gl.sum(w * gl.expand_dims(v, 1), axis=0)
        if SLOTS < total:
            gl.thread_barrier()
            fence_async_shared()
            _issue(w13_desc, w2_desc, smem, bars, c + SLOTS, gu_total, total, g0, d0, idv, lanes, H, I,
                   BLOCK_N, G, GG, GD, GGB, GDB, GUC, DNC, SLOTS)
        return acc

    @gluon.jit
    def _rows_dot(w13_desc, w2_desc, smem, bars, c, vs, gu_total, total, g0, d0, idv, lanes, H, I,
                  N_COPIES: gl.constexpr, L3: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  G: gl.constexpr,
                  GG: gl.constexpr, GD: gl.constexpr, GGB: gl.constexpr, GDB: gl.constexpr, GUC: gl.constexpr,
                  DNC: gl.constexpr, SLOTS: gl.constexpr):
        """The BLOCK_N rows of copies c .. c + N_COPIES - 1 (one row block over all of K) times
        their inputs vs (group q: rows [q * G, q * G + G)): fp32 [BLOCK_N]."""
        acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, gl.SliceLayout(0, L3))
        for q in gl.static_range(N_COPIES):
            acc = _consume(w13_desc, w2_desc, smem, bars, c + q, acc, vs.slice(q * G, G), gu_total, total, g0, d0,
                           idv, lanes, H, I, L3, BLOCK_N, G, GG, GD, GGB, GDB, GUC, DNC, SLOTS)
        return gl.sum(acc, axis=1)

    @gluon.jit
    def _moe_tma_kernel(w13_desc, w2_desc, x_ptr, ids_ptr, tw_ptr, act_ptr, y_ptr, out_ptr, cnt_ptr,
                        T, H, I, stride_x, stride_o,
                        BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, G: gl.constexpr, GG: gl.constexpr,
                        GD: gl.constexpr, GGB: gl.constexpr, GDB: gl.constexpr, GUC: gl.constexpr,
                        DNC: gl.constexpr, TOP_K: gl.constexpr, T_PAD: gl.constexpr, DN_MAX: gl.constexpr,
                        SLOTS: gl.constexpr, WN: gl.constexpr, USE_PDL: gl.constexpr,
                        LATE_DEPS: gl.constexpr = False, t_ptr=None, TIMED: gl.constexpr = False,
                        DOWN_ONLY: gl.constexpr = False):
        """DOWN_ONLY (``moe_tma_down_triton``): no gate/up tiles; act_ptr holds the activations
        the kernel before wrote, and the ids are already valid at launch, so the down copies are
        issued before the PDL wait."""
        pid = gl.program_id(0)
        _stamp(t_ptr, pid, 0, TIMED)
        nprog = gl.num_programs(0)
        rb_i = I // BLOCK_N
        rb_h = H // BLOCK_N
        n_gu = 0 if DOWN_ONLY else T * TOP_K * rb_i  # gate/up tiles (entry, rows of I)
        n_dn = T * TOP_K * rb_h  # down tiles (entry, rows of H)
        # contiguous ranges of both: a program's tiles lie in one or two experts (each new expert
        # in a program's copy stream costs it an address translation before its copies can go)
        g0 = pid * n_gu // nprog
        d0 = pid * n_dn // nprog
        my_gu = (pid + 1) * n_gu // nprog - g0
        my_dn = (pid + 1) * n_dn // nprog - d0
        gu_total = my_gu * (2 * GUC)
        total = gu_total + my_dn * DNC
        smem = gl.allocate_shared_memory(w13_desc.dtype, [SLOTS, G, BLOCK_N, BLOCK_K], w13_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(SLOTS):
            mbarrier.init(bars.index(i), count=1)
        # x per token as GUC groups of G rows [BLOCK_K] (row r of group q: chunk q * GG + r of H,
        # zero for r >= GG and past H), the activations per entry likewise (DNC groups, GD chunks
        # of I each): the input side of copy q is the slice of rows [q * G, q * G + G)
        XP: gl.constexpr = _pow2(GUC * G)
        AP: gl.constexpr = _pow2(DNC * G)
        S_PAD: gl.constexpr = T_PAD * TOP_K
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        xs = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [T_PAD, XP, BLOCK_K], flat)
        acts = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [S_PAD, AP, BLOCK_K], flat)
        # a copy [G, BLOCK_N, BLOCK_K]: each thread 16-byte runs along K of all G chunks (their
        # sum stays in the thread), lanes along K, warps over the rows
        L3: gl.constexpr = gl.BlockedLayout([G, 1, 8], [1, 32 * 8 // BLOCK_K, BLOCK_K // 8], [1, WN, 1], [2, 1, 0])
        L2: gl.constexpr = gl.SliceLayout(0, L3)
        YL: gl.constexpr = gl.SliceLayout(1, L2)
        PL: gl.constexpr = gl.BlockedLayout([S_PAD], [32], [WN], [0])  # small vectors, whole in each thread
        SL: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [WN, 1], [1, 0])
        if GG < G or GD < G:  # slot chunks a copy leaves alone hold finite values (they meet zero inputs)
            for i in gl.static_range(SLOTS):
                smem.index(i).store(gl.zeros([G, BLOCK_N, BLOCK_K], w13_desc.dtype, L3))
            gl.thread_barrier()
            fence_async_shared()
        lanes = gl.arange(0, S_PAD, layout=PL)
        offs_n = gl.arange(0, BLOCK_N, layout=YL)
        dt = out_ptr.dtype.element_ty
        ki = gl.expand_dims(gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, SL)), 0)
        c = 0
        if DOWN_ONLY:  # the ids come from a kernel that ended before the one this waits on
            idv = gl.load(ids_ptr + lanes, mask=lanes < T * TOP_K, other=0, cache_modifier=".cg")
            for i in gl.static_range(SLOTS):  # the preload: in flight while the gate/up launch runs
                _issue(w13_desc, w2_desc, smem, bars, i, gu_total, total, g0, d0, idv, lanes, H, I,
                       BLOCK_N, G, GG, GD, GGB, GDB, GUC, DNC, SLOTS)
            _stamp(t_ptr, pid, 2, TIMED)
        if USE_PDL:
            _gdc_wait()
        _stamp(t_ptr, pid, 1, TIMED)
        if DOWN_ONLY:  # (no x, no gate/up tiles, no handoff)
            for i in gl.static_range(3, 6):
                _stamp(t_ptr, pid, i, TIMED)
        if not DOWN_ONLY:
            # the three inputs from the kernels before, loaded at once (their round trips overlap)
            idv = gl.load(ids_ptr + lanes, mask=lanes < T * TOP_K, other=0)
            # x staged through a 2-D view [rows, BLOCK_K]: row = token * XP + group row
            ri = gl.expand_dims(gl.arange(0, T_PAD * XP, layout=gl.SliceLayout(1, SL)), 1)
            xr = ri % XP
            xk = ((xr // G) * GG + xr % G) * BLOCK_K + ki
            xv = gl.load(x_ptr + (ri // XP) * stride_x + xk, mask=(ri // XP < T) & (xr % G < GG) & (xk < H), other=0.0)
            for i in gl.static_range(SLOTS):  # the ring's first copies, then x while they fly
                _issue(w13_desc, w2_desc, smem, bars, i, gu_total, total, g0, d0, idv, lanes, H, I,
                       BLOCK_N, G, GG, GD, GGB, GDB, GUC, DNC, SLOTS)
            _stamp(t_ptr, pid, 2, TIMED)
            xs._reinterpret(x_ptr.dtype.element_ty, [T_PAD * XP, BLOCK_K], flat).store(xv)
            gl.thread_barrier()
            _stamp(t_ptr, pid, 3, TIMED)
            for u in range(0, my_gu):  # gate/up tiles
                tile = g0 + u
                s = tile // rb_i
                xt = xs.index(s // TOP_K)
                gate = _rows_dot(w13_desc, w2_desc, smem, bars, c, xt, gu_total, total, g0, d0, idv, lanes, H, I, GUC,
                                 L3, BLOCK_N, BLOCK_K, G, GG, GD, GGB, GDB, GUC, DNC, SLOTS).to(dt).to(gl.float32)
                up = _rows_dot(w13_desc, w2_desc, smem, bars, c + GUC, xt, gu_total, total, g0, d0, idv, lanes, H, I,
                               GUC, L3, BLOCK_N, BLOCK_K, G, GG, GD, GGB, GDB, GUC, DNC, SLOTS).to(dt).to(gl.float32)
                c += 2 * GUC
                a = (gate / (1.0 + gl.exp(-gate))).to(dt).to(gl.float32)
                gl.store(act_ptr + s * I + (tile % rb_i) * BLOCK_N + offs_n, (a * up).to(dt))
            _stamp(t_ptr, pid, 4, TIMED)
            # the handoff: every program's activations are written before any program reads them
            gl.thread_barrier()
            gl.atomic_add(cnt_ptr, 1, sem="release")
            arrived = gl.atomic_add(cnt_ptr, 0, sem="acquire")
            while arrived < nprog:
                arrived = gl.atomic_add(cnt_ptr, 0, sem="acquire")
            if gl.atomic_add(cnt_ptr + 1, 1, sem="relaxed") == nprog - 1:  # the last one through resets both
                gl.atomic_xchg(cnt_ptr + 1, 0, sem="relaxed")
                gl.atomic_xchg(cnt_ptr, 0, sem="relaxed")
        if USE_PDL and not LATE_DEPS:
            _gdc_launch_dependents()
        _stamp(t_ptr, pid, 5, TIMED)
        # the activations of every entry (from L2: written by other SMs)
        ai = gl.expand_dims(gl.arange(0, S_PAD * AP, layout=gl.SliceLayout(1, SL)), 1)  # entry * AP + group row
        ar = ai % AP
        ak = ((ar // G) * GD + ar % G) * BLOCK_K + ki
        av = gl.load(act_ptr + (ai // AP) * I + ak, mask=(ai // AP < T * TOP_K) & (ar % G < GD) & (ak < I),
                     other=0.0, cache_modifier=".cg")
        acts._reinterpret(x_ptr.dtype.element_ty, [S_PAD * AP, BLOCK_K], flat).store(av)
        gl.thread_barrier()
        for v in range(0, my_dn):  # down tiles: one entry's expert output, rounded, for BLOCK_N rows
            tile = d0 + v
            s = tile // rb_h
            yv = _rows_dot(w13_desc, w2_desc, smem, bars, c, acts.index(s), gu_total, total, g0, d0, idv, lanes, H,
                           I, DNC, L3, BLOCK_N, BLOCK_K, G, GG, GD, GGB, GDB, GUC, DNC, SLOTS)
            c += DNC
            gl.store(y_ptr + s * H + (tile % rb_h) * BLOCK_N + offs_n, yv.to(dt))
        _stamp(t_ptr, pid, 6, TIMED)
        # the combine: per (token, row block) the program whose down tile arrives last sums the
        # TOP_K expert outputs, weighted, in k order (one vector of arrivals per program)
        gl.thread_barrier()  # every thread's y stores are issued before the release below
        CL: gl.constexpr = gl.BlockedLayout([1, 1, S_PAD], [32 // BLOCK_N, BLOCK_N, 1], [WN, 1, 1], [2, 1, 0])
        VL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, CL))
        vi = gl.arange(0, DN_MAX, layout=VL)
        tile_v = d0 + vi
        cid = (tile_v // rb_h // TOP_K) * rb_h + tile_v % rb_h  # (token, row block)
        old = gl.atomic_add(cnt_ptr + 2 + cid, gl.full([DN_MAX], 1, gl.int32, VL),
                            mask=vi < my_dn, sem="acq_rel")
        won = (vi < my_dn) & (old == TOP_K - 1)
        if gl.max(won.to(gl.int32), axis=0) > 0:
            t3 = gl.expand_dims(gl.expand_dims(tile_v // rb_h // TOP_K, 1), 2)
            nb3 = gl.expand_dims(gl.expand_dims(tile_v % rb_h, 1), 2)
            w3 = gl.expand_dims(gl.expand_dims(won, 1), 2)
            r3 = gl.expand_dims(gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, CL))),
                                               0), 2)
            j3 = gl.expand_dims(gl.expand_dims(gl.arange(0, S_PAD, layout=gl.SliceLayout(0, gl.SliceLayout(1, CL))),
                                               0), 1)
            jk = j3 < TOP_K
            yv = gl.load(y_ptr + (t3 * TOP_K + j3) * H + nb3 * BLOCK_N + r3, mask=w3 & jk, other=0.0,
                         cache_modifier=".cg").to(gl.float32)
            wv = gl.load(tw_ptr + t3 * TOP_K + j3, mask=w3 & jk, other=0.0)
            tot = gl.sum(yv * wv, axis=2)
            t2 = gl.expand_dims(tile_v // rb_h // TOP_K, 1)
            nb2 = gl.expand_dims(tile_v % rb_h, 1)
            r2 = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, CL))), 0)
            gl.store(out_ptr + t2 * stride_o + nb2 * BLOCK_N + r2, tot.to(dt), mask=gl.expand_dims(won, 1))
            gl.atomic_xchg(cnt_ptr + 2 + cid, gl.zeros([DN_MAX], gl.int32, VL), mask=won, sem="relaxed")
        for i in gl.static_range(SLOTS):
            mbarrier.invalidate(bars.index(i))
        if USE_PDL and LATE_DEPS:
            _gdc_launch_dependents()
        _stamp(t_ptr, pid, 7, TIMED)


def moe_tma_config(T: int, H: int, I: int, top_k: int, itemsize: int, sms: int,
                   smem_bytes: int = MOE_TMA_SMEM) -> Optional[dict]:
    """The launch's tiles for T tokens (None where they do not fit): BLOCK_K 256 values, copies
    of ``MOE_TMA_COPY_BYTES`` (G chunks x BLOCK_N rows), GUC / DNC copies per gate-or-up part /
    per expert of a down tile, one program per SM (or per tile where there are fewer), and as
    many ring slots as the shared memory left after x and the activations holds (at least 3).
    E.g. H200, bf16, Qwen3-30B-A3B at one token: 16-row tiles, 4 chunks per copy, 132
    programs of 2-3 gate/up tiles (128 KB each) and 0-1 down tiles (8 experts x 24 KB), 6 slots."""
    bk = MOE_TMA_BLOCK_K
    if H % bk or I % bk or not 1 <= T <= MOE_TMA_MAX_TOKENS:
        return None
    g = 4
    bn = MOE_TMA_COPY_BYTES // (g * bk * itemsize)
    if I % bn or H % bn:
        return None
    # chunks per copy: the largest divisor of the row's chunks up to G (whole copies, no box
    # past a row's end: such copies measured far slower on the H200)
    gg = max(d for d in range(1, g + 1) if (H // bk) % d == 0)
    gd = max(d for d in range(1, g + 1) if (I // bk) % d == 0)
    guc, dnc = H // bk // gg, I // bk // gd
    ggb, gdb = gg & -gg, gd & -gd  # their largest power-of-two factors: the TMA box's chunks
    t_pad = next_pow2(T)
    fixed = (t_pad * next_pow2(guc * g) + t_pad * top_k * next_pow2(dnc * g)) * bk * itemsize + 1024
    copy = g * bn * bk * itemsize
    slots = (smem_bytes - fixed) // copy
    if slots < 3:
        return None
    return {"BLOCK_N": bn, "BLOCK_K": bk, "G": g, "GG": gg, "GD": gd, "GGB": ggb, "GDB": gdb, "GUC": guc, "DNC": dnc, "T_PAD": t_pad, "SLOTS": slots,
            "programs": sms, "WN": MOE_TMA_WARPS, "num_warps": MOE_TMA_WARPS}


@functools.lru_cache(maxsize=256)
def _cached_config(T, H, I, top_k, itemsize, sms, smem_bytes):
    return moe_tma_config(T, H, I, top_k, itemsize, sms, smem_bytes)


def moe_tma_down_config(T: int, H: int, I: int, top_k: int, itemsize: int, sms: int,
                        smem_bytes: int = MOE_TMA_SMEM) -> Optional[dict]:
    """The down-only launch's tiles (``moe_tma_down_triton``; None where they do not fit): a
    copy is one 256-value chunk of MOE_TMA_DOWN_COPY_BYTES // 512 rows (G = 1: every copy
    whole, whatever I's chunk count), a down tile one entry's BLOCK_N rows over all of I (DNC
    copies), one program per SM, and as many ring slots as the shared memory left after the
    activations holds. E.g. H200, bf16, Qwen3-30B-A3B at one token: 32-row tiles, 512 tiles
    over 132 programs (at most 4 tiles, 12 copies of 16 KB), 12 slots: each program's whole
    share in flight before the wait."""
    bk = MOE_TMA_BLOCK_K
    if H % bk or I % bk or not 1 <= T <= MOE_TMA_MAX_TOKENS:
        return None
    bn = min(32, MOE_TMA_DOWN_COPY_BYTES // (bk * itemsize))  # the combine's layout takes <= 32 rows
    if H % bn:
        return None
    dnc = I // bk
    t_pad = next_pow2(T)
    fixed = (t_pad + t_pad * top_k * next_pow2(dnc)) * bk * itemsize + 1024
    copy = bn * bk * itemsize
    slots = (smem_bytes - fixed) // copy
    if slots < 3:
        return None
    return {"BLOCK_N": bn, "BLOCK_K": bk, "G": 1, "GG": 1, "GD": 1, "GGB": 1, "GDB": 1, "GUC": 1, "DNC": dnc,
            "T_PAD": t_pad, "SLOTS": slots, "programs": sms, "WN": MOE_TMA_WARPS, "num_warps": MOE_TMA_WARPS}


@functools.lru_cache(maxsize=256)
def _cached_down_config(T, H, I, top_k, itemsize, sms, smem_bytes):
    return moe_tma_down_config(T, H, I, top_k, itemsize, sms, smem_bytes)


def moe_tma_ok(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """Whether ``moe_tma_triton`` runs these: Hopper with PDL, 1-2 tokens, bf16/fp16 contiguous
    expert weights, H and I multiples of 256, every buffer fitting one SM's shared memory."""
    if MOE_TMA != "1":
        return False
    return _shapes_ok(x, w13, w2) and _cached_config(x.shape[0], x.shape[1], w2.shape[2], topk_ids.shape[-1],
                                                      x.element_size(), device_sms(x), MOE_TMA_SMEM) is not None


def moe_tma_down_ok(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """Whether the direct path's down GEMM runs as ``moe_tma_down_triton`` (BLITZ_MOE_TMA_DOWN, the
    same conditions as ``moe_tma_ok``, its own tiles)."""
    if not MOE_TMA_DOWN:
        return False
    return _shapes_ok(x, w13, w2) and _cached_down_config(x.shape[0], x.shape[1], w2.shape[2], topk_ids.shape[-1],
                                                           x.element_size(), device_sms(x), MOE_TMA_SMEM) is not None


def _shapes_ok(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Hopper with PDL and Gluon; x [T, H] and contiguous, 16-byte aligned expert weights of one
    16-bit dtype."""
    if not HAS_GLUON or not (x.is_cuda and w13.is_cuda) or not pdl_enabled(x):
        return False
    if capability(x)[0] != 9 or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not (w13.dtype == w2.dtype == x.dtype and w13.is_contiguous() and w2.is_contiguous()):
        return False
    return not (w13.data_ptr() % 16 or w2.data_ptr() % 16)


TIMELINE = ("start", "wait over", "copies issued", "x staged", "gate/up done", "handoff", "down done", "end")
# BLITZ_MOE_TMA_TIMES=path (diagnostics): every launch records its timeline (a buffer per call,
# so per captured layer too); at exit the last decode step's launches are summarised into path
_TIMES_PATH = os.environ.get("BLITZ_MOE_TMA_TIMES", "")
_TIMES = []


def _diag_times(programs: int, device: torch.device) -> torch.Tensor:
    if not _TIMES:
        import atexit
        atexit.register(_dump_times)
    _TIMES.append(torch.zeros(programs, 8, dtype=torch.int64, device=device))
    return _TIMES[-1]


def _dump_times(last: int = 48) -> None:
    """Mean over the latest ``last`` launches of each point (us after the launch's own wait):
    min / median / max over programs; the period between launches and the gap from one
    launch's last program to the next launch's wait."""
    runs = [t[:, :len(TIMELINE)].double().cpu() / 1000.0 for t in _TIMES]
    runs = sorted((t for t in runs if bool((t[:, 0] > 0).all())), key=lambda t: t[:, 0].min().item())[-last:]
    if not runs:
        return
    rows = {name: torch.zeros(3, dtype=torch.float64) for name in TIMELINE}
    for t in runs:
        rel = t - t[:, 1].min()
        for j, name in enumerate(TIMELINE):
            rows[name] += torch.stack([rel[:, j].min(), rel[:, j].median(), rel[:, j].max()]) / len(runs)
    waits = [t[:, 1].min().item() for t in runs]
    gaps = [waits[i + 1] - runs[i][:, len(TIMELINE) - 1].max().item() for i in range(len(runs) - 1)]
    with open(_TIMES_PATH, "w") as f:
        f.write(f"TMA MoE timeline, mean of the last {len(runs)} launches (us after each launch's PDL wait; "
                f"min / median / max over programs)\n")
        for name, v in rows.items():
            f.write(f"  {name:<14} {v[0]:8.2f} {v[1]:8.2f} {v[2]:8.2f}\n")
        if gaps:
            f.write(f"  period between launches {(waits[-1] - waits[0]) / (len(waits) - 1):8.2f}; from a launch's "
                    f"last program to the next launch's wait {sum(gaps) / len(gaps):8.2f}\n")


def moe_tma_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, *, out: Optional[torch.Tensor] = None, config: Optional[dict] = None,
                   times: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [T <= 2, H], w13 [E, 2I, H], w2 [E, H, I], topk weights (fp32) / ids [T, K] -> [T, H] in
    x's dtype (``config``: moe_tma_config's keys, tests and benchmarks). Every id must be a
    valid expert (no dropped entries). ``times`` (diagnostics): int64 [programs, 8] receiving
    each program's %globaltimer at ``TIMELINE``'s points."""
    assert HAS_GLUON and x.is_cuda, "the TMA MoE needs a Hopper GPU and Gluon"
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    K = topk_ids.shape[-1]
    cfg = config or _cached_config(T, H, I, K, x.element_size(), device_sms(x), MOE_TMA_SMEM)
    assert cfg is not None, "shapes outside the TMA MoE (see moe_tma_ok)"
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    act = torch.empty(T * K, I, dtype=x.dtype, device=x.device)
    _launch(x, w13, w2, act, topk_weights, topk_ids, out, cfg, times, down_only=False)
    return out


def moe_tma_down_triton(act: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, out: torch.Tensor, *, config: Optional[dict] = None,
                        times: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The down GEMM and the weighted combine of the direct path: act [T * K, I] (the activated
    intermediate of each (token, k) entry, in order), w2 [E, H, I] -> out [T, H] (written).
    The launch reads the ids before its PDL wait: they must come from a kernel that ended
    before the one this launch waits on (the gate/up launch waits on the routing, then lets
    this launch start). ``config``: moe_tma_down_config's keys. w13 is not read (its shapes
    and dtype are checked)."""
    assert HAS_GLUON and act.is_cuda, "the TMA MoE needs a Hopper GPU and Gluon"
    T, H = out.shape
    I = w2.shape[2]
    K = topk_ids.shape[-1]
    assert act.shape == (T * K, I) and act.is_contiguous() and w2.shape[1] == H
    cfg = config or _cached_down_config(T, H, I, K, act.element_size(), device_sms(act), MOE_TMA_SMEM)
    assert cfg is not None, "shapes outside the TMA MoE (see moe_tma_down_ok)"
    _launch(out, w13, w2, act, topk_weights, topk_ids, out, cfg, times, down_only=True)
    return out


def _launch(x, w13, w2, act, topk_weights, topk_ids, out, cfg, times, down_only: bool) -> None:
    T, H = out.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    K = topk_ids.shape[-1]
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    y = torch.empty(T * K, H, dtype=out.dtype, device=out.device)  # each entry's expert output
    bn, bk, g = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["G"]
    dn_max = next_pow2(triton.cdiv(T * K * (H // bn), cfg["programs"]))  # down tiles per program, at most
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * out.element_size(), rank=3)
    d2 = TensorDescriptor(w2, [I // bk, E * H, bk], [bk, I, 1], [cfg["GDB"], bn, bk], layout)
    # (down only: no gate/up copies, the down descriptor stands in for the gate/up one)
    d13 = d2 if down_only else TensorDescriptor(w13, [H // bk, E * two_i, bk], [bk, H, 1], [cfg["GGB"], bn, bk],
                                                layout)
    if times is None and _TIMES_PATH:
        times = _diag_times(cfg["programs"], out.device)
    pdl = pdl_enabled(out)
    kw = {"launch_pdl": True} if pdl else {}
    _moe_tma_kernel[(cfg["programs"],)](
        # counters: the handoff's arrivals and departures, then the combine's per (token, row block)
        d13, d2, x, ids, tw, act, y, out, _counters(out.device, 2 + MOE_TMA_MAX_TOKENS * (H // bn)), T, H, I,
        x.stride(0), out.stride(0),
        BLOCK_N=bn, BLOCK_K=bk, G=g, GG=cfg["GG"], GD=cfg["GD"], GGB=cfg["GGB"],
        GDB=cfg["GDB"], GUC=cfg["GUC"], DNC=cfg["DNC"], TOP_K=K, T_PAD=cfg["T_PAD"], DN_MAX=dn_max,
        SLOTS=cfg["SLOTS"], WN=cfg["WN"], USE_PDL=pdl, LATE_DEPS=MOE_TMA_LATE_DEPS, t_ptr=times,
        TIMED=times is not None, DOWN_ONLY=down_only, num_warps=cfg["num_warps"], **kw)


def reference_moe_tma(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    """The torch form: ``moe.reference_fused_moe``."""
    from .moe import reference_fused_moe
    return reference_fused_moe(x, w13, w2, topk_weights, topk_ids)
