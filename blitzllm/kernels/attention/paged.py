"""Attention over the paged KV cache: split-K decode (optionally fused with q/k norm, rotary and
the cache write) and varlen causal prefill: the launchers, their torch references and the
public ops (the Triton kernels are ``paged_kernels.py``). No host sync: CUDA-graph safe.
"""
import functools
from typing import Optional

import torch

from .._common import device_sms, next_pow2, pdl_enabled, pdl_launch_kwargs, triton, unit_stride, use_triton
from .paged_kernels import _decode_kernel, _decode_reduce_kernel, _prefill_kernel
from .qk_norm_rope_cache import _check as _check_qk

_LOG2E = 1.4426950408889634


def _check_cache(q, k_cache, v_cache):
    assert k_cache.shape == v_cache.shape and k_cache.dim() == 4
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    assert k_cache.shape[3] == d and hq % hkv == 0
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    return hq, hkv, d


# Decode constants (docs/gpu-performance.md#decode-attention): the most splits of one
# sequence's context, enough programs to cover the GPU for short batches; keys per tile; fp32
# partial values per warp the combine loads a round (its rounds' L2 round trips are dependent).
_MAX_SPLITS = 32
_DECODE_BLOCK_N = 32
_COMBINE_ELEMS_PER_WARP = 1024


def decode_warps(group: int) -> int:
    """Warps per decode program for ``group`` query heads per KV head: 8 from 8 heads on (few
    KV heads, so few programs, each with a larger tile), else 4."""
    return 8 if group >= 8 else 4


def _default_splits(q, b, hkv):
    # enough programs to cover the GPU about twice, at most _MAX_SPLITS splits
    want = triton.cdiv(2 * device_sms(q), max(1, b * hkv))
    return max(1, min(_MAX_SPLITS, next_pow2(want)))


_MAX_COUNTERS = 1 << 16


@functools.lru_cache(maxsize=None)
def _split_counters(device: torch.device) -> torch.Tensor:
    """Zeroed arrival counters for the fused split-K reduce; every launch leaves them at 0."""
    return torch.zeros(_MAX_COUNTERS, dtype=torch.int32, device=device)


def paged_decode_attention_triton(
    q, k_cache, v_cache, block_tables, seq_lens, scale,
    num_splits: Optional[int] = None, block_n: Optional[int] = None,
    num_stages: int = 2, early_v: bool = True, fused_reduce: bool = True, _fuse=None,
    num_warps: Optional[int] = None, early_dependents: bool = False,
):
    """q [B, Hq, D] -> [B, Hq, D]. ``num_splits`` / ``block_n`` / ``num_warps`` default to
    ``_default_splits``, ``_DECODE_BLOCK_N``, ``decode_warps``. ``fused_reduce``: the last split
    to finish merges the partials (else a second launch). ``early_dependents`` (PDL): the next
    kernel may launch as this one starts (the TMA GEMV)."""
    hq, hkv, d = _check_cache(q, k_cache, v_cache)
    B = q.shape[0]
    q = unit_stride(q)
    out = q if _fuse is not None else torch.empty_like(q)  # fused: q is the (empty) output buffer
    if B == 0:
        return out
    if _fuse is None:  # plain decode: q [B, Hq, D] is ready
        q_arg, stride_qb, stride_qh = q, q.stride(0), q.stride(1)
        fuse_kw = dict(pos_ptr=seq_lens, cs_ptr=seq_lens, stride_cs=0, qw_ptr=q, kw_ptr=q, slot_ptr=seq_lens,
                       Hq=hq, eps=0.0, FUSE_QK=False, HAS_NORM=False, ROT=2)
    else:  # q/k norm + rotary + cache write fused in: q_arg is the qkv projection output
        qkv, positions, cos_sin, qw, kw, slots, eps, rot = _fuse
        q_arg, stride_qb, stride_qh = qkv, qkv.stride(0), d
        has_norm = qw is not None
        fuse_kw = dict(pos_ptr=positions, cs_ptr=cos_sin, stride_cs=cos_sin.stride(0),
                       qw_ptr=qw if has_norm else qkv, kw_ptr=kw if has_norm else qkv, slot_ptr=slots,
                       Hq=hq, eps=float(eps), FUSE_QK=True, HAS_NORM=has_norm, ROT=rot)
    g = hq // hkv
    s = num_splits or _default_splits(q, B, hkv)
    g_pad, d_pad = max(16, next_pow2(g)), next_pow2(d)
    bn = block_n or _DECODE_BLOCK_N
    ieee = q.dtype == torch.float32
    fused = fused_reduce and s > 1 and B * hkv <= _MAX_COUNTERS
    if s > 1:
        m = torch.empty((B, hq, s), dtype=torch.float32, device=q.device)
        l_ = torch.empty_like(m)
        acc = torch.empty((B, hq, s, d_pad), dtype=torch.float32, device=q.device)
    else:
        m = l_ = acc = out
    cnt = _split_counters(q.device) if fused else seq_lens
    pdl = pdl_enabled(q) and (s == 1 or fused)
    g_comb = next_pow2(g)  # the combine's tiles hold the real heads only
    warps = num_warps or decode_warps(g)
    combine = max(1, min(next_pow2(s), _COMBINE_ELEMS_PER_WARP * warps // (g_comb * d_pad)))
    _decode_kernel[(B, hkv, s)](
        q_arg, k_cache, v_cache, block_tables, seq_lens, out, m, l_, acc, cnt,
        stride_qb, stride_qh, out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        float(scale) * _LOG2E, g,
        NUM_SPLITS=s, G_PAD=g_pad, D=d, D_PAD=d_pad, BLOCK_N=bn,
        BLOCK_SIZE=k_cache.shape[1], IEEE=ieee, EARLY_V=early_v, FUSED_REDUCE=fused,
        USE_PDL=pdl, G_COMB=g_comb, COMBINE=combine, **fuse_kw,
        EARLY_DEPS=bool(early_dependents) and bool(pdl), num_warps=warps,
        num_stages=num_stages, **pdl_launch_kwargs(pdl),
    )
    if s > 1 and not fused:
        _decode_reduce_kernel[(B, hq)](
            m, l_, acc, out, out.stride(0), out.stride(1), hq,
            NUM_SPLITS=s, S_PAD=next_pow2(s), D=d, D_PAD=d_pad, num_warps=4,
        )
    return out


def fused_decode_attention_triton(
    qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slot_mapping,
    block_tables, seq_lens, scale, q_norm_weight=None, k_norm_weight=None, eps=1e-6, rotary_dim=None,
    num_splits: Optional[int] = None, block_n: Optional[int] = None, num_warps: Optional[int] = None,
    early_dependents: bool = False,
):
    """One decode step of one layer in one launch, qkv [B, (Hq + 2 Hkv) * D] -> [B, Hq, D]: the
    numerics of ``fused_qk_norm_rope_cache_triton`` then ``paged_decode_attention_triton``. Each
    query token must be its sequence's only new token (rows never read each other's new k/v)."""
    rot = _check_qk(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, rotary_dim,
                    q_norm_weight, k_norm_weight, False)
    assert (q_norm_weight is None) == (k_norm_weight is None)
    assert cos_sin_cache.shape[-1] == rot and cos_sin_cache.stride(-1) == 1
    qkv = unit_stride(qkv)
    B = qkv.shape[0]
    out = qkv.new_empty((B, num_heads, head_dim))  # the launcher's q argument: shape, dtype, output
    return paged_decode_attention_triton(
        out, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=num_splits, block_n=block_n,
        num_warps=num_warps, early_dependents=early_dependents,
        _fuse=(qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, slot_mapping, eps, rot))


def paged_prefill_attention_triton(
    q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_q_len,
    block_m: Optional[int] = None, block_n: Optional[int] = None,
    num_warps: Optional[int] = None, num_stages: int = 3,
):
    hq, hkv, d = _check_cache(q, k_cache, v_cache)
    q = unit_stride(q)
    out = torch.empty_like(q)
    B = seq_lens.shape[0]
    if q.shape[0] == 0 or B == 0 or max_q_len <= 0:
        return out
    g = hq // hkv
    g_pad, d_pad = next_pow2(g), next_pow2(d)
    rows = max(block_m or (128 if d_pad <= 128 else 64), 16, g_pad)
    block_q = rows // g_pad
    bn = block_n or (64 if d_pad <= 128 else 32)
    grid = (triton.cdiv(int(max_q_len), block_q), B, hkv)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        float(scale) * _LOG2E, g,
        G_PAD=g_pad, BLOCK_Q=block_q, D=d, D_PAD=d_pad, BLOCK_N=bn,
        BLOCK_SIZE=k_cache.shape[1], IEEE=q.dtype == torch.float32,
        num_warps=num_warps or (8 if rows >= 128 else 4), num_stages=num_stages,
    )
    return out


# ---------------------------------------------------------------- references
def _gather_kv(cache, table_row, n):
    bs = cache.shape[1]
    nb = (n + bs - 1) // bs
    return cache[table_row[:nb].long()].reshape(nb * bs, *cache.shape[2:])[:n].float()


def _ref_attend(q, k, v, q_pos, scale):
    """q [L, Hq, D], k/v [N, Hkv, D] (fp32); q_pos [L] positions; -> [L, Hq, D] fp32."""
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    s = torch.einsum("lhd,nhd->hln", q.float(), k) * scale
    kpos = torch.arange(k.shape[0], device=q.device)
    s = s.masked_fill(kpos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hln,nhd->lhd", torch.softmax(s, dim=-1), v)


def reference_paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
    out = torch.zeros_like(q)
    for b, n in enumerate(seq_lens.tolist()):
        if n <= 0:
            continue
        k = _gather_kv(k_cache, block_tables[b], n)
        v = _gather_kv(v_cache, block_tables[b], n)
        pos = torch.tensor([n - 1], device=q.device)
        out[b] = _ref_attend(q[b:b + 1], k, v, pos, scale)[0].to(q.dtype)
    return out


def reference_paged_prefill_attention(
    q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_q_len=None
):
    out = torch.zeros_like(q)
    qsl = query_start_loc.tolist()
    for b, n in enumerate(seq_lens.tolist()):
        s0, s1 = qsl[b], qsl[b + 1]
        if s1 <= s0:
            continue
        k = _gather_kv(k_cache, block_tables[b], n)
        v = _gather_kv(v_cache, block_tables[b], n)
        pos = torch.arange(n - (s1 - s0), n, device=q.device)
        out[s0:s1] = _ref_attend(q[s0:s1], k, v, pos, scale).to(q.dtype)
    return out


# ------------------------------------------------------------------- public
def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """q [B, Hq, D], one query per sequence at position seq_len - 1 -> [B, Hq, D]."""
    fn = paged_decode_attention_triton if use_triton(q) else reference_paged_decode_attention
    return fn(q, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_prefill_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                            scale, max_q_len):
    """Varlen causal attention of q [T, Hq, D] over the paged cache -> [T, Hq, D]."""
    fn = paged_prefill_attention_triton if use_triton(q) else reference_paged_prefill_attention
    return fn(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_q_len)
