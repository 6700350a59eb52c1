"""CPU decode steps of a dense pre-norm decoder (Llama, Qwen2, Qwen3) in few ops: one function
per layer (``layer_step``) takes the layer's weights as arguments, so one compiled graph
(torch.compile, inductor's C++ backend; its code cached on disk by inductor) serves every layer
of every step, with the batch size (1, or 2 and more) and the context length as its only
shapes. The residual add + RMSNorm, rotary, the paged KV-cache write, attention over the
gathered cache rows and SiLU-and-mul fuse around the weight-only quantized matmuls
(``kernels/cpu_quant``) or float ones. Runs eagerly (the same function, no compiler) when
compiling is off. Numerics as the eager model's CPU path (HF's): fp32 statistics, the same
rotary tables. An eager step that is fp32 end to end skips it: the whole step, token ids to
logits, in one C call (``kernels/cpu_decode`` ``DecodeLayers``, with ``kernels/cpu_quant``'s
matmuls).

Knows nothing of requests; the runner hands it one pure-decode step's host lists.
"""
from __future__ import annotations

import os
import time
from typing import Optional

import torch
import torch.nn.functional as F

from .. import envs
from ..kernels import cpu_decode, cpu_gemm
from ..kernels.attention.kv_store import is_fp8
from ..kernels.cpu_quant import native
from ..kernels.norm.rmsnorm import reference_rms_norm
from ..layers.linear import Linear
from ..layers.rotary import rotary_tables

_COMPILE_OPTIONS = {"fx_graph_cache": True}


def supports(model, kv_caches, backend, tp_size: int, states) -> bool:
    """Whether this model's decode can run here: a dense pre-norm decoder of plain layers on
    the CPU, one rank, the torch attention backend, no recurrent states, a KV cache of the
    activations' dtype or fp8."""
    inner = getattr(model, "model", None)
    if tp_size != 1 or states is not None or backend.name != "torch" or inner is None:
        return False
    layers = getattr(inner, "layers", None)
    if not layers or not isinstance(getattr(model, "lm_head", None), Linear):
        return False
    act = inner.embed_tokens.weight.dtype  # the activations' dtype
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not hasattr(mlp, "gate_up_proj") or not hasattr(attn, "qkv_proj"):
            return False
        a = attn.attn
        if a.pre_norm is not None or a.full_width_qk_norm or a.rotary.rotary_dim != a.head_dim:
            return False
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if not isinstance(lin, Linear) or lin.qweight is not None or lin.fp8_block is not None:
                return False
            if lin.quant is None and lin.weight.dtype != act and not _bf16_native(lin, act):
                return False  # (other weight-only forms: Linear computes those in the weight's dtype)
        if mlp.down_proj.bias is not None or mlp.gate_up_proj.bias is not None or attn.o_proj.bias is not None:
            return False
    # (an fp8 KV cache: the C forms below read and write it; CpuDecode leaves it to the model's own
    # layers where none of them applies)
    return all(k.device.type == "cpu" and (k.dtype == act or is_fp8(k.dtype)) for k, _ in kv_caches)


def _bf16_native(lin: Linear, act_dtype: torch.dtype) -> bool:
    """A bf16 weight under fp32 activations (``--weight-dtype bfloat16``) that our kernel takes;
    under bf16 activations (``--dtype bfloat16``) torch's bf16 GEMM, as the model's own path."""
    return (lin.quant is None and lin.weight.dtype == torch.bfloat16 and act_dtype == torch.float32
            and native.lib() is not None)


def _weights(lin: Linear, act_dtype: torch.dtype) -> tuple:
    """A linear as step arguments: (float weight,), (codes, d, m) of our GGUF kernel ((weight,
    None, None) for a bf16 weight it widens), or torch's int4 packing (packed, scales_zeros) per
    4-bit matrix (kernels/cpu_quant/pack.py)."""
    q = lin.quant
    if q is None:
        return (lin.weight, None, None) if _bf16_native(lin, act_dtype) else (lin.weight,)
    if q.parts is None:
        return (q.codes, q.d, q.m)
    return tuple(t for part in q.parts for t in part)


def _as(t: torch.Tensor, dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _mm(x: torch.Tensor, w: tuple) -> torch.Tensor:
    """x @ W.T: in x's dtype for a float weight, fp32 from our GGUF kernel; from torch's int4
    kernel bf16 (fp32 when two parts add), which the next op widens where it needs to."""
    if len(w) == 1:
        return F.linear(x, _as(w[0], x.dtype))
    if len(w) == 3:
        if torch.compiler.is_compiling():
            return native.gguf_matmul_op(_as(x, torch.float32), *w)
        return native.matmul(_as(x, torch.float32).contiguous(), *w)
    xb = _as(x, torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w[0], 32, w[1])
    for i in range(2, len(w), 2):
        y = y.float() + torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w[i], 32, w[i + 1])
    return y


def _norm(x, w, eps):
    """RMSNorm as the model's CPU path: torch's one op in fp32, else the reference's roundings."""
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return reference_rms_norm(x, w, eps)


def layer_step(x, residual, ln1, ln2, qkv_w: tuple, qkv_b, q_norm, k_norm, o_w: tuple, gu_w: tuple, dn_w: tuple,
               k_cache, v_cache, cos, sin, slots, gidx, is_new, mask, dims: tuple):
    """One decoder layer for B decode rows: x, residual [B, H] -> (mlp out, new residual, k, v),
    k / v [B, Hkv, D] the rows' new cache entries: written here to cache rows ``slots`` [B], or
    with ``slots`` None by the caller (a compiled graph copies a cache it writes whole).
    ``cos`` / ``sin`` [B, 1, D] (rotary_tables), ``gidx`` [B, L] the cache rows each row attends
    to, its own new entry at ``is_new`` [B, L, 1, 1], ``mask`` [B, 1, 1, L] (None: every row
    attends to all L). ``dims``: (heads, kv heads, head dim, intermediate, eps, scale, q/k norm
    eps). The mlp output may be bf16 (the next add widens it)."""
    hq, hkv, d, inter, eps, scale, qk_eps = dims
    B, L, dt = x.shape[0], gidx.shape[1], residual.dtype
    res = x + residual  # (x + 0 for the first layer)
    qkv = _as(_mm(_norm(res, ln1, eps), qkv_w), dt)
    if qkv_b is not None:
        qkv = qkv + qkv_b
    heads = qkv.view(B, hq + 2 * hkv, d)
    qk, v = heads[:, :hq + hkv], heads[:, hq + hkv:]
    if q_norm is not None:
        qk = torch.cat([_norm(qk[:, :hq], q_norm, qk_eps), _norm(qk[:, hq:], k_norm, qk_eps)], 1)
    half = d // 2
    qf = _as(qk, torch.float32)
    qk = _as(qf * cos + torch.cat([qf[..., half:], qf[..., :half]], -1) * sin, dt)
    q, k = qk[:, :hq], _as(qk[:, hq:], k_cache.dtype)
    v = _as(v, v_cache.dtype)
    kc, vc = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    flat = gidx.reshape(-1)
    if slots is not None:  # eager: write first, then read the rows back (fewer ops than a where)
        kc.index_copy_(0, slots, k)
        vc.index_copy_(0, slots, v)
        kg, vg = kc.index_select(0, flat).view(B, L, hkv, d), vc.index_select(0, flat).view(B, L, hkv, d)
    else:
        kg = torch.where(is_new, k[:, None], kc.index_select(0, flat).view(B, L, hkv, d))
        vg = torch.where(is_new, v[:, None], vc.index_select(0, flat).view(B, L, hkv, d))
    kg, vg = _as(kg.transpose(1, 2), dt), _as(vg.transpose(1, 2), dt)  # [B, Hkv, L, D]
    gqa = hq != hkv
    if gqa and torch.compiler.is_compiling():  # (dims may be symbolic there; enable_gqa takes a bool)
        kg, vg, gqa = kg.repeat_interleave(hq // hkv, 1), vg.repeat_interleave(hq // hkv, 1), False
    o = F.scaled_dot_product_attention(q[:, :, None], kg, vg, attn_mask=mask, scale=scale, enable_gqa=gqa)
    h2 = _mm(o.reshape(B, hq * d), o_w) + res
    gu = _as(_mm(_norm(h2, ln2, eps), gu_w), dt)
    act = F.silu(gu[:, :inter]) * gu[:, inter:]
    return _mm(act, dn_w), h2, k, v


class CpuDecode:
    """Pure-decode steps of a supported model (``supports``); ``compiled``: through
    torch.compile (compiled on the first step of each shape class, or by ``warm_up``)."""

    def __init__(self, model, kv_caches, block_size: int, compiled: bool):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.compiled = compiled
        inner = model.model
        self.embed, self.norm, self.lm_head = inner.embed_tokens, inner.norm, model.lm_head
        self.rotary = inner.layers[0].self_attn.attn.rotary
        self.layers = []
        act = inner.embed_tokens.weight.dtype
        for layer in inner.layers:
            sa, mlp = layer.self_attn, layer.mlp
            a = sa.attn
            qn, kn = a.q_norm, a.k_norm
            dims = (a.num_heads, a.num_kv_heads, a.head_dim, mlp.down_proj.in_features,
                    layer.input_layernorm.eps, a.scale, qn.eps if qn is not None else 1e-6)
            self.layers.append((layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                _weights(sa.qkv_proj, act), sa.qkv_proj.bias,
                                qn.weight if qn is not None else None, kn.weight if kn is not None else None,
                                _weights(sa.o_proj, act), _weights(mlp.gate_up_proj, act),
                                _weights(mlp.down_proj, act), dims))
        self.out_dtype = {1: act, 2: torch.bfloat16}.get(len(self.layers[0][8]), torch.float32)
        self.step_fn = layer_step
        lin_ws = [(layer[2], layer[6], layer[7], layer[8]) for layer in self.layers]  # qkv, o, gate_up, down
        one_dims = len({layer[9] for layer in self.layers}) == 1
        # eager and fp32 end to end (fp32 embeddings and KV cache; every linear GGUF blocks or a
        # bf16 weight through our kernel, or an fp32 weight): the whole step's layers in one C call
        f32, fp8 = torch.float32, torch.float8_e4m3fn
        self.step_layers = None
        if (not compiled and cpu_decode.available() and native.lib() is not None and self.embed.weight.dtype == f32
                and self.embed.weight.is_contiguous() and self.norm.weight.dtype == f32
                and all(k.dtype in (f32, fp8) and v.dtype == k.dtype for k, v in kv_caches)
                and all(len(w) == 3 or w[0].dtype == f32 for ws in lin_ws for w in ws) and one_dims):
            hq, hkv, d, inter, eps, scale, qk_eps = self.layers[0][9]
            self.step_layers = cpu_decode.DecodeLayers(
                [(*layer[:2], *layer[3:6], *(w if len(w) == 3 else (w[0], None, None) for w in ws), kc, vc)
                 for layer, ws, (kc, vc) in zip(self.layers, lin_ws, kv_caches)],  # (ln1, ln2, qkv bias, q/k norm)
                hq, hkv, d, inter, eps, qk_eps, scale, self._ends(act), native.gemm_addresses())
        # eager and bf16 end to end with plain bf16 weights (--dtype bfloat16): torch's bf16 GEMMs
        # (the CPU's bf16 / AMX units) with our C glue between them, layer by layer
        bf = torch.bfloat16
        self.bf16_glue = (not compiled and cpu_decode.available() and self.embed.weight.dtype == bf
                          and all(k.dtype in (bf, fp8) and v.dtype == k.dtype for k, v in kv_caches)
                          and all(len(w) == 1 and w[0].dtype == bf for ws in lin_ws for w in ws)
                          and all(t is None or t.dtype == bf for layer in self.layers for t in layer[:2] + layer[3:6])
                          and all(layer[9][2] % 16 == 0 and layer[9][2] <= 1024 for layer in self.layers))
        self.packed = self.bf16_glue and _pack_all(model)
        # one row of it (batch 1): every layer in one C call, the linears on our one-row bf16 loop
        self.step_bf16 = None
        if (self.bf16_glue and cpu_gemm.gemv_lib() is not None and one_dims
                and all(w[0].is_contiguous() for ws in lin_ws for w in ws)):
            (hq, hkv, d, inter, eps, scale, qk_eps), hidden = self.layers[0][9], self.embed.weight.shape[1]
            self.step_bf16 = cpu_decode.DecodeLayersBf16(
                [(*layer[:2], *layer[3:6], *(w[0] for w in ws), kc, vc)
                 for layer, ws, (kc, vc) in zip(self.layers, lin_ws, kv_caches)],
                hq, hkv, d, inter, eps, qk_eps, scale, hidden, cpu_gemm.gemv_address())
        # the bf16 form's linears: the packed GEMM called directly (a module call's checks cost
        # about 20 us each, 3 ms a SmolLM2 step), else the modules
        self.linears = [tuple(_direct(m) for m in (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj))
                        for sa, mlp in ((layer.self_attn, layer.mlp) for layer in inner.layers)]
        if compiled:
            self.step_fn = torch.compile(layer_step, fullgraph=True, options=_COMPILE_OPTIONS)
        self.compile_s = 0.0

    def _ends(self, act: torch.dtype) -> tuple:
        """The one-call step's ends (cpu_decode.DecodeLayers): the embedding, the rotary cache,
        the final norm, and the lm_head where our kernels take its form (else the step returns
        the normed hidden state and compute_logits runs here)."""
        head = self.lm_head
        w = _weights(head, act)
        lin = w if len(w) == 3 else (w[0], None, None) if w[0].dtype == torch.float32 else None
        if head.bias is not None or not w[0].is_contiguous():
            lin = None
        self.head_in_step = lin is not None
        return (self.embed.weight, self.rotary.cos_sin_cache.float().contiguous(), self.norm.weight, self.norm.eps,
                lin, self.block_size)

    def warm_up(self, batch_sizes=(1,)) -> float:
        """Compile (or load from the cache) the step for these batch sizes now; returns seconds."""
        t = time.perf_counter()
        for b in batch_sizes:
            with torch.inference_mode():
                # a throw-away row writing into cache row 0 of block 0 (rewritten by any real step)
                self.run([0] * b, [0] * b, [0] * b, [1] * b, [[0]] * b)
        self.compile_s += time.perf_counter() - t
        return time.perf_counter() - t

    def _gather_index(self, lens, block_tables):
        bs = self.block_size
        L = max(lens)
        nblk = -(-L // bs)
        bt = torch.tensor([t[:nblk] + [0] * (nblk - len(t[:nblk])) for t in block_tables], dtype=torch.int64)
        gidx = (bt[:, :, None] * bs + torch.arange(bs)).view(len(lens), -1)[:, :L].contiguous()
        lens_t = torch.tensor(lens)[:, None]
        is_new = (torch.arange(L)[None, :] == lens_t - 1)[:, :, None, None]
        mask = None
        if len(lens) > 1:  # (always a mask past one row: one graph, not two)
            mask = (torch.arange(L)[None, :] < lens_t)[:, None, None, :]
        return gidx, is_new, mask

    def run(self, ids, pos, slots, lens, block_tables) -> torch.Tensor:
        """One decode step: host lists per row -> fp32 logits [B, V]."""
        if self.step_layers is not None:
            out = self.step_layers.step(ids, pos, lens, block_tables)
            return out if self.head_in_step else self.model.compute_logits(out)
        ids_t, pos_t, slots_t = (torch.tensor(v, dtype=torch.int64) for v in (ids, pos, slots))
        gidx, is_new, mask = self._gather_index(lens, block_tables)
        if self.compiled:
            torch._dynamo.mark_dynamic(gidx, 1)
            torch._dynamo.mark_dynamic(is_new, 1)
            if mask is not None:
                torch._dynamo.mark_dynamic(mask, 3)
        cos, sin = rotary_tables(self.rotary.cos_sin_cache, pos_t)
        residual = self.embed(ids_t)
        if self.bf16_glue:
            return self._run_bf16(residual, cos, sin, slots_t, gidx, torch.tensor(lens, dtype=torch.int64))
        # the first layer adds zeros of the dtype a layer returns (bf16 from a packed down_proj): the
        # same graph as the others
        x = torch.zeros(residual.shape, dtype=self.out_dtype)
        if self.compiled and len(ids) > 1:  # one graph for every batch of 2 and more
            for t in (x, residual, cos, sin, gidx, is_new) + (() if mask is None else (mask,)):
                torch._dynamo.mark_dynamic(t, 0)
        step, write = self.step_fn, None if self.compiled else slots_t
        for (ln1, ln2, qkv_w, qkv_b, qn, kn, o_w, gu_w, dn_w, dims), (kc, vc) in zip(self.layers, self.kv_caches):
            x, residual, k, v = step(x, residual, ln1, ln2, qkv_w, qkv_b, qn, kn, o_w, gu_w, dn_w, kc, vc,
                                     cos, sin, write, gidx, is_new, mask, dims)
            if write is None:
                hkv, d = kc.shape[2], kc.shape[3]
                kc.view(-1, hkv, d).index_copy_(0, slots_t, k)
                vc.view(-1, hkv, d).index_copy_(0, slots_t, v)
        h, _ = self.norm(_as(x, residual.dtype), residual)
        return self.model.compute_logits(h)

    def _run_bf16(self, residual, cos, sin, slots, gidx, lens) -> torch.Tensor:
        """The bf16 forms: one row in one C call (``step_bf16``: DecodeLayersBf16), else our C glue
        between torch's bf16 GEMMs, layer by layer; then the final norm and the logits."""
        B = residual.shape[0]
        cos, sin = cos.reshape(B, -1).contiguous(), sin.reshape(B, -1).contiguous()
        x = torch.zeros_like(residual)
        if self.step_bf16 is not None and B == 1:
            self.step_bf16.run(x, residual, cos, sin, slots, gidx, lens)
        else:
            layers = zip(self.layers, self.kv_caches, self.linears)
            for (ln1, ln2, _, _, qn, kn, _, _, _, dims), (kc, vc), (qkv_proj, o_proj, gate_up, down) in layers:
                hq, hkv, d, inter, eps, scale, qk_eps = dims
                qkv = qkv_proj(cpu_decode.add_rms_norm(x, residual, ln1, eps))
                o = cpu_decode.decode_attention(qkv, qn, kn, qk_eps, cos, sin, kc, vc, slots, gidx, lens, hq, hkv,
                                                d, scale)
                x = o_proj(o)
                gu = gate_up(cpu_decode.add_rms_norm(x, residual, ln2, eps))
                x = down(F.silu(gu[:, :inter]) * gu[:, inter:])
        h, _ = self.norm(x, residual)
        return self.model.compute_logits(h)


def _direct(lin: Linear):
    """``lin`` as a function of x: its bf16 GEMM (kernels/cpu_gemm) where it has a packed copy,
    else the module."""
    if lin.cpu_packed is None:
        return lin
    w, packed, bias = lin.weight, lin.cpu_packed, lin.bias
    return lambda x: cpu_gemm.matmul(x, w, packed, bias)


def _pack_all(model) -> bool:
    """oneDNN-packed copies of the decoder's bf16 linears and the lm_head (kernels/cpu_gemm), set
    on the modules (their forward takes them, prefill too); only while the copies take at most a
    quarter of the memory available now, and all or none."""
    inner = model.model
    lins = [m for layer in inner.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                  layer.mlp.gate_up_proj, layer.mlp.down_proj)] + [model.lm_head]
    need = sum(m.weight.numel() * m.weight.element_size() for m in lins)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        avail = 0
    if need * 4 > avail:
        return False
    packed = [cpu_gemm.pack(m.weight) for m in lins]
    if any(p is None for p in packed):
        return False
    for m, p in zip(lins, packed):
        m.cpu_packed = p
    return True


def maybe_cpu_decode(model, kv_caches, backend, block_size: int, tp_size: int, states,
                     enforce_eager: bool) -> Optional[CpuDecode]:
    """The CPU decode path, or None: unsupported, or ``enforce_eager`` (every step through the
    model's modules, whose hooks EAGLE-3 and MTP read). Compiled, its two graphs (batch 1; 2 and
    more) are compiled or loaded from inductor's cache here, at start-up, not in a first request."""
    if enforce_eager or not supports(model, kv_caches, backend, tp_size, states):
        return None
    # BLITZ_CPU_COMPILE (envs.py): off by default (docs/cpu.md says why)
    dec = CpuDecode(model, kv_caches, block_size, compiled=bool(envs.get("BLITZ_CPU_COMPILE")))
    if is_fp8(kv_caches[0][0].dtype) and dec.step_layers is None and not dec.bf16_glue:
        return None   # (layer_step reads and writes 16/32-bit caches; the model's layers take fp8 ones)
    if dec.compiled:
        dec.warm_up((1, 2))
    return dec
