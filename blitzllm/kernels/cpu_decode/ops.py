"""Launchers of ``decode.c`` (built and loaded by ``kernels/_cbuild.py``) and their torch
references. Every tensor is contiguous on the CPU, fp32, or bf16 throughout (rotary tables
fp32), the KV caches of that dtype or fp8 (e4m3, ``kv_cache_dtype="fp8"``); the caches are
viewed as [rows, Hkv, D] (row = block * block_size + offset)."""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from .. import _cbuild
from ..attention.kv_store import copy_rows, is_fp8
from ..norm.rmsnorm import reference_rms_norm

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_ATTN = ([_P, _P, _P, _F] + [_P] * 7 + [_I] * 5 + [_F, _P, _P, _I, _I], _I)
_SIGNATURES = {"blitz_add_rms_norm": ([_P] * 4 + [_I, _I, _F], None),
               "blitz_add_rms_norm_bf16": ([_P] * 5 + [_I, _I, _F], None),
               "blitz_decode_attention": _ATTN, "blitz_decode_attention_bf16": _ATTN,
               "blitz_greedy": ([_P, _I, _I, _P, _P], _I), "blitz_to_e4m3": ([_P, _P, ctypes.c_int64], None),
               "blitz_decode_step": ([_P, _I, _P, _P, _I, _I, _P, _P, _I, _P, _P], _I),
               "blitz_decode_step_scratch": ([_P, _I, _I, _I], ctypes.c_size_t),
               "blitz_decode_layers_bf16": ([_P, _I, _P, _P, _P, _P, _I] + [_P] * 5 + [_I, _P, _P], _I)}
# AVX-512 as kernels/cpu_quant's (the one-call step needs those kernels anyway): the bf16 forms'
# widening loads and the attention's dots vectorize 16 wide
_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mfma", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC")
_NEEDS = ("avx512f", "avx512bw", "fma")
_state: dict = {}


def _lib():
    if "lib" not in _state:
        _state["lib"] = _cbuild.load(Path(__file__).with_name("decode.c"), _FLAGS, _NEEDS, _SIGNATURES)
    return _state["lib"]


def available() -> bool:
    return _lib() is not None


def _bf16(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None else t.data_ptr()


def add_rms_norm(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float,
                 res_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """res += x (in place; bf16: into ``res_out`` instead where given); returns rmsnorm(res + x) * w.
    x, res [B, H], all fp32 or all bf16."""
    B, H = res.shape
    out = torch.empty_like(res)
    if _bf16(res):
        r = res if res_out is None else res_out
        _state["lib"].blitz_add_rms_norm_bf16(x.data_ptr(), res.data_ptr(), r.data_ptr(), w.data_ptr(),
                                              out.data_ptr(), B, H, eps)
    else:
        _state["lib"].blitz_add_rms_norm(x.data_ptr(), res.data_ptr(), w.data_ptr(), out.data_ptr(), B, H, eps)
    return out


def reference_add_rms_norm(x, res, w, eps):
    if _bf16(res):  # the model's bf16 roundings (kernels/norm's reference forms)
        res.copy_(x.float() + res.float())
        return reference_rms_norm(res, w, eps)
    res += x
    return F.rms_norm(res, (res.shape[-1],), w, eps)


def decode_attention(qkv: torch.Tensor, q_norm: Optional[torch.Tensor], k_norm: Optional[torch.Tensor], qk_eps: float,
                     cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, gidx: torch.Tensor, lens: torch.Tensor, hq: int, hkv: int, d: int,
                     scale: float) -> torch.Tensor:
    """qkv [B, (hq + 2 hkv) d] (q and k normed and rotated in place); cos / sin [B, d]; the new
    k / v written to cache rows ``slots`` [B]; row b attends to rows gidx[b, :lens[b]] ([B, L]
    int64); the caches of qkv's dtype or fp8. Returns o [B, hq d]."""
    B, L = gidx.shape
    bf = _bf16(qkv)
    out = qkv.new_empty(B, hq * d)
    scratch = torch.empty(B * hq * (L + (d if bf else 0)))
    fn = _state["lib"].blitz_decode_attention_bf16 if bf else _state["lib"].blitz_decode_attention
    rc = fn(qkv.data_ptr(), _ptr(q_norm), _ptr(k_norm), qk_eps, cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), slots.data_ptr(), gidx.data_ptr(), lens.data_ptr(), L, B, hq, hkv, d, scale,
            out.data_ptr(), scratch.data_ptr(), torch.get_num_threads(), int(is_fp8(k_cache.dtype)))
    if rc:
        raise ValueError(f"CPU decode attention: head dim {d} must be {'a multiple of 16' if bf else 'even'} "
                         "and at most 1024")
    return out


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` as the e4m3 entries the C forms write into an fp8 cache (reference:
    ``kernels/attention/kv_store.to_cache``)."""
    x = x.float().contiguous()
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    _state["lib"].blitz_to_e4m3(x.data_ptr(), out.data_ptr(), x.numel())
    return out


def reference_decode_attention(qkv, q_norm, k_norm, qk_eps, cos, sin, k_cache, v_cache, slots, gidx, lens, hq, hkv, d,
                               scale):
    B, L = gidx.shape
    heads = qkv.view(B, hq + 2 * hkv, d)
    qk, v = heads[:, :hq + hkv], heads[:, hq + hkv:]
    if q_norm is not None:
        qk[:, :hq] = reference_rms_norm(qk[:, :hq], q_norm, qk_eps)
        qk[:, hq:] = reference_rms_norm(qk[:, hq:], k_norm, qk_eps)
    half = d // 2
    qf = qk.float()
    qk.copy_(qf * cos[:, None] + torch.cat([qf[..., half:], qf[..., :half]], -1) * sin[:, None])
    kc, vc = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    copy_rows(kc, slots, qk[:, hq:])
    copy_rows(vc, slots, v)
    kg = kc.index_select(0, gidx.reshape(-1)).view(B, L, hkv, d).transpose(1, 2).to(qkv.dtype)
    vg = vc.index_select(0, gidx.reshape(-1)).view(B, L, hkv, d).transpose(1, 2).to(qkv.dtype)
    mask = (torch.arange(L)[None, :] < lens[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(qk[:, :hq, None], kg, vg, attn_mask=mask, scale=scale, enable_gqa=hq != hkv)
    return o.reshape(B, hq * d)


def greedy(logits: torch.Tensor) -> Optional[tuple]:
    """(argmax token [B] int64, its log-softmax [B] fp32) of logits [B, V], as
    kernels/greedy's reference_greedy_sample; None where a row holds a NaN (take the reference)."""
    x = logits.float().contiguous()
    B, V = x.shape
    tok, lp = torch.empty(B, dtype=torch.int64), torch.empty(B)
    return None if _state["lib"].blitz_greedy(x.data_ptr(), B, V, tok.data_ptr(), lp.data_ptr()) else (tok, lp)


# ---- the whole step: decode.c's blitz_decode_step ---------------------------------------------
class _Linear(ctypes.Structure):
    _fields_ = [("codes", _P), ("d", _P), ("m", _P), ("N", _I), ("K", _I), ("kind", _I)]


_KINDS = {torch.uint8: 0, torch.int8: 1, torch.bfloat16: 2, torch.float32: 3}  # (decode.c's Q4, Q8, BF16, F32)


def _linear(codes: torch.Tensor, d: Optional[torch.Tensor], m: Optional[torch.Tensor]) -> _Linear:
    k = codes.shape[1] * (2 if codes.dtype == torch.uint8 else 1)
    return _Linear(codes.data_ptr(), _ptr(d), _ptr(m), codes.shape[0], k, _KINDS[codes.dtype])


class _Layer(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("ln1", "ln2", "qkv_bias", "q_norm", "k_norm")] + \
               [(n, _Linear) for n in ("qkv", "o", "gate_up", "down")] + [("k_cache", _P), ("v_cache", _P)]


class _Dims(ctypes.Structure):
    _fields_ = [(n, _I) for n in ("hq", "hkv", "d", "inter", "nthreads", "kv_fp8")] + \
               [(n, _F) for n in ("eps", "qk_eps", "scale")] + [("q4", _P), ("q8", _P), ("dense", _P)]


class _Ends(ctypes.Structure):
    _fields_ = [("embed", _P), ("cos_sin", _P), ("norm", _P), ("norm_eps", _F), ("head", _Linear),
                ("vocab", _I), ("max_pos", _I), ("block_size", _I), ("num_blocks", _I)]


class DecodeLayers:
    """A whole fp32 decode step in one C call: token ids, positions and block tables in, logits
    out. ``layers``: per layer (ln1, ln2, qkv_bias, q_norm, k_norm, qkv, o, gate_up, down,
    k_cache, v_cache), each linear (codes, d, m) of kernels/cpu_quant (a q4 / q8 block form by the
    codes' dtype; a dense bf16 or fp32 weight with d and m None); ``ends``: (embedding [V, H],
    the rotary cos_sin cache [P, D], the final norm's weight and eps, the lm_head as a linear
    above or None, the KV cache's block size); ``gemm``: the addresses of cpu_quant's
    blitz_q4_gemm, blitz_q8_gemm and blitz_dense_gemm. Holds the tensors it points to."""

    def __init__(self, layers: list, hq: int, hkv: int, d: int, inter: int, eps: float, qk_eps: float, scale: float,
                 ends: tuple, gemm: tuple):
        self.tensors = (layers, ends)
        embed, cos_sin, norm, norm_eps, head, self.block_size = ends
        self.hidden = embed.shape[1]
        arr = (_Layer * len(layers))()
        for c, (ln1, ln2, bias, qn, kn, qkv, o, gu, dn, kc, vc) in zip(arr, layers):
            c.ln1, c.ln2, c.qkv_bias, c.q_norm, c.k_norm = map(_ptr, (ln1, ln2, bias, qn, kn))
            for name, lin in zip(("qkv", "o", "gate_up", "down"), (qkv, o, gu, dn)):
                setattr(c, name, _linear(*lin))
            c.k_cache, c.v_cache = kc.data_ptr(), vc.data_ptr()
        self.arr = arr
        self.dims = _Dims(hq, hkv, d, inter, 1, int(is_fp8(layers[0][9].dtype)), eps, qk_eps, scale, *gemm)
        self.ends = _Ends(embed.data_ptr(), cos_sin.data_ptr(), norm.data_ptr(), norm_eps,
                          _Linear() if head is None else _linear(*head), embed.shape[0], cos_sin.shape[0],
                          self.block_size, layers[0][9].shape[0])
        self.width = self.hidden if head is None else head[0].shape[0]  # the output's row
        self.scratch = torch.empty(0)
        self.out: dict = {}

    def step(self, ids: list, pos: list, lens: list, tables: list) -> torch.Tensor:
        """Host lists per row (token id, position, context length with the new token, block
        table) -> logits [B, V] fp32 (the normed hidden state [B, H] without a head). The
        tensor is this object's and is rewritten by the next step of the same batch size."""
        B, bs, L = len(ids), self.block_size, max(lens)
        nblk = -(-L // bs)
        flat = []
        for t in tables:
            flat += t[:nblk] if len(t) >= nblk else t + [-1] * (nblk - len(t))
        lib = _state["lib"]
        need = lib.blitz_decode_step_scratch(ctypes.byref(self.dims), B, self.hidden, L)
        if self.scratch.numel() < need + 16:  # (need floats from a 64-byte aligned start; room to grow)
            self.scratch = torch.empty(need + need // 2 + 16)
        off = (-self.scratch.data_ptr() // 4) % 16
        out = self.out.get(B)
        if out is None:
            out = self.out[B] = torch.empty(B, self.width)
        self.dims.nthreads = torch.get_num_threads()
        rc = lib.blitz_decode_step(
            ctypes.byref(self.arr), len(self.arr), ctypes.byref(self.dims), ctypes.byref(self.ends), B, self.hidden,
            (ctypes.c_int64 * (3 * B))(*ids, *pos, *lens), (ctypes.c_int32 * len(flat))(*flat), nblk,
            out.data_ptr(), self.scratch.data_ptr() + 4 * off)
        if rc == 2:
            raise ValueError("CPU decode step: a token id, position or context length out of range")
        if rc:
            raise ValueError("CPU decode step: an unsupported shape (head dim even and <= 1024, K % 32 == 0)")
        return out


# ---- a batch-1 bf16 step: decode.c's blitz_decode_layers_bf16 --------------------------------
class _LayerBf16(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("ln1", "ln2", "qkv_bias", "q_norm", "k_norm", "qkv", "o", "gate_up", "down",
                                  "k_cache", "v_cache")]


class DecodeLayersBf16:
    """Every layer of a one-row bf16 decode step in one C call: the layer-by-layer bf16 form
    without Python between its ops. ``layers``: per layer (ln1, ln2, qkv_bias, q_norm, k_norm,
    qkv, o, gate_up, down, k_cache, v_cache), bf16, weights [N, K] contiguous; ``gemv``: the
    address of kernels/cpu_gemm's blitz_gemv_bf16. Holds the tensors it points to."""

    def __init__(self, layers: list, hq: int, hkv: int, d: int, inter: int, eps: float, qk_eps: float, scale: float,
                 hidden: int, gemv: int):
        self.tensors, self.gemv = layers, gemv
        self.hidden, self.hq, self.d = hidden, hq, d
        self.buf = torch.empty(hidden + (hq + 2 * hkv) * d + hq * d + 3 * inter, dtype=torch.bfloat16)
        arr = (_LayerBf16 * len(layers))()
        for c, ts in zip(arr, layers):
            for (name, _), t in zip(_LayerBf16._fields_, ts):
                setattr(c, name, _ptr(t))
        self.arr = arr
        self.dims = _Dims(hq, hkv, d, inter, 1, int(is_fp8(layers[0][9].dtype)), eps, qk_eps, scale, None, None, None)

    def run(self, x: torch.Tensor, res: torch.Tensor, cos, sin, slots, gidx, lens) -> None:
        """x, res [1, H] bf16: x the last layer's output, res the residual stream, in place."""
        L = gidx.shape[1]
        self.dims.nthreads = torch.get_num_threads()
        scratch = torch.empty(self.hq * (L + self.d))
        rc = _state["lib"].blitz_decode_layers_bf16(
            ctypes.byref(self.arr), len(self.arr), ctypes.byref(self.dims), self.gemv, x.data_ptr(), res.data_ptr(),
            self.hidden, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), gidx.data_ptr(), lens.data_ptr(), L,
            self.buf.data_ptr(), scratch.data_ptr())
        if rc:
            raise ValueError("CPU bf16 decode step: an unsupported shape (head dim a multiple of 16, <= 1024)")
