"""Gated delta net ops (kernels/gdn): the decode post-conv Triton kernel against its torch
reference (interpreter on the CPU, compiled on a GPU), the chunked rule against the
token-by-token rule and against transformers' torch functions (the oracle's own code), the
conv with carried states, and the sm_90 compile of the kernel. Random data, awkward sizes
(non-power-of-two head dims, one token, chunk boundaries)."""
import pytest
import torch

from blitzllm.kernels import gdn
from blitzllm.kernels.gdn import post_conv, recurrent
from blitzllm.kernels.gdn.reference import (
    reference_causal_conv1d, reference_causal_conv1d_update, reference_chunk_gated_delta_rule,
    reference_post_conv_decode, reference_recurrent_gated_delta_rule,
)
from tests.kernels.conftest import HAS_CUDA, assert_close_ulps, assert_gdn_sm90_no_spills


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _rule_inputs(lengths, hk, hv, dk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    q, k = torch.randn(T, hk, dk, generator=g), torch.randn(T, hk, dk, generator=g)
    v = torch.randn(T, hv, dv, generator=g)
    # decays as the layer makes them: -exp(A_log) * softplus(a + dt_bias), some of them strong
    decay = -torch.rand(hv, generator=g).mul(4).exp() * torch.nn.functional.softplus(torch.randn(T, hv, generator=g))
    beta = torch.rand(T, hv, generator=g)
    h0 = torch.randn(N, hv, dk, dv, generator=g)
    return q, k, v, decay, beta, h0


@pytest.mark.parametrize("lengths,hk,hv,dk,dv", [
    ([37, 1, 64, 65, 130], 2, 4, 16, 8),
    ([1], 1, 1, 24, 20),
    ([5, 129], 3, 6, 12, 16),
])
def test_chunk_rule_matches_recurrent_rule_and_transformers(lengths, hk, hv, dk, dv):
    """The chunked prefill rule (varlen, initial states, chunk boundaries at 64 and 128) equals
    the token-by-token rule, and transformers' torch_chunk_gated_delta_rule run sequence by
    sequence, outputs and final states."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    q, k, v, g, beta, h0 = _rule_inputs(lengths, hk, hv, dk, dv)
    cu = _cu(lengths)
    o_c, s_c = reference_chunk_gated_delta_rule(q, k, v, g, beta, cu, h0, use_qk_l2norm=True)
    o_r, s_r = reference_recurrent_gated_delta_rule(q, k, v, g, beta, cu, h0, use_qk_l2norm=True)
    torch.testing.assert_close(o_c, o_r, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s_c, s_r, atol=2e-5, rtol=1e-4)
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        o_hf, s_hf = torch_chunk_gated_delta_rule(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e],
                                                  beta[None, s:e], initial_state=h0[n:n + 1],
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o_c[s:e], o_hf[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(s_c[n], s_hf[0], atol=2e-5, rtol=1e-4)
    # no initial state = zeros
    o0, _ = reference_chunk_gated_delta_rule(q, k, v, g, beta, cu, None, use_qk_l2norm=True)
    oz, _ = reference_chunk_gated_delta_rule(q, k, v, g, beta, cu, torch.zeros_like(h0), use_qk_l2norm=True)
    torch.testing.assert_close(o0, oz)


def test_rule_carries_state_across_chunks_of_a_prompt():
    """A prompt computed in two pieces, the second from the first's final state, gives the
    outputs and final state of the whole prompt (chunked prefill); a decode step from there
    equals the next token of a longer prompt."""
    q, k, v, g, beta, h0 = _rule_inputs([50], 2, 4, 16, 8, seed=3)
    whole_o, whole_s = reference_chunk_gated_delta_rule(q, k, v, g, beta, [0, 50], h0[:1], use_qk_l2norm=True)
    o1, s1 = reference_chunk_gated_delta_rule(q[:29], k[:29], v[:29], g[:29], beta[:29], [0, 29], h0[:1],
                                              use_qk_l2norm=True)
    o2, s2 = reference_chunk_gated_delta_rule(q[29:], k[29:], v[29:], g[29:], beta[29:], [0, 21], s1,
                                              use_qk_l2norm=True)
    torch.testing.assert_close(torch.cat([o1, o2]), whole_o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s2, whole_s, atol=2e-5, rtol=1e-4)
    # the decode entry (q, k normalized by the caller) from the state after 49 tokens
    _, s49 = reference_chunk_gated_delta_rule(q[:49], k[:49], v[:49], g[:49], beta[:49], [0, 49], h0[:1],
                                              use_qk_l2norm=True)
    state = torch.cat([torch.randn(2, 4, 16, 8), s49])
    qn, kn = gdn.reference_l2norm(q[49:]), gdn.reference_l2norm(k[49:])
    o = gdn.gated_delta_rule_decode(qn, kn, v[49:], g[49:], beta[49:], state, torch.tensor([2]))
    torch.testing.assert_close(o, whole_o[49:], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state[2], whole_s[0], atol=2e-5, rtol=1e-4)


def _hf_conv(x, weight, prev):
    """transformers' causal_conv1d_update on [1, C, L] from a K-column state (its layout)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_update
    return causal_conv1d_update(x.t()[None], prev.clone()[None], weight, None, activation="silu")[0].t()


@pytest.mark.parametrize("K", [4, 3])
def test_conv_prefill_and_update_match_transformers(K):
    """The varlen conv (states carried in from some slots, zeros for others, sequences shorter
    than the kernel) equals transformers' conv over [state, x]; its conv states then hold each
    sequence's last K - 1 inputs, and a one-token update from them equals transformers' too."""
    gen = torch.Generator().manual_seed(1)
    C, lengths = 12, [7, 1, 2, 20]
    cu = _cu(lengths)
    x = torch.randn(cu[-1], C, generator=gen)
    w = torch.randn(C, K, generator=gen)
    state = torch.randn(6, K - 1, C, generator=gen)
    before = state.clone()
    slots, has_initial = [4, 0, 2, 5], [True, True, False, True]
    y = reference_causal_conv1d(x, w, None, state, slots, has_initial, cu)
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        prev = before[slots[n]] if has_initial[n] else torch.zeros(K - 1, C)
        hf_state = torch.cat([torch.zeros(1, C), prev]).t()  # [C, K]: transformers keeps K columns
        torch.testing.assert_close(y[s:e], _hf_conv(x[s:e], w, hf_state))
        ext = torch.cat([prev, x[s:e]])
        torch.testing.assert_close(state[slots[n]], ext[-(K - 1):])
    torch.testing.assert_close(state[[1, 3]], before[[1, 3]])  # other slots untouched
    x1 = torch.randn(2, C, generator=gen)
    idx = torch.tensor([5, 2])
    prev = state[idx].clone()
    y1 = reference_causal_conv1d_update(x1, w, None, state, idx)
    for r in range(2):
        hf_state = torch.cat([torch.zeros(1, C), prev[r]]).t()
        torch.testing.assert_close(y1[r:r + 1], _hf_conv(x1[r:r + 1], w, hf_state))
        torch.testing.assert_close(state[idx[r]], torch.cat([prev[r], x1[r:r + 1]])[1:])


def _post_conv_inputs(B, hk, dk, hv, dv, K, dtype, bias, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = 2 * hk * dk + hv * dv
    wide = torch.randn(B, C + 2 * hv * dv + 5, generator=g)  # the packed projection's output: q|k|v then z, b, a ...
    mixed = wide[:, :C].to(dtype)
    ab = torch.randn(B, 2 * hv + 3, generator=g).to(dtype)
    b, a = ab[:, :hv], ab[:, hv:2 * hv]
    state = torch.randn(2 * B + 3, K - 1, C, generator=g).to(dtype)
    slots = torch.randperm(2 * B + 3, generator=g)[:B].to(torch.int32)
    w = (torch.randn(C, K, generator=g) * 0.5).to(dtype)
    cb = torch.randn(C, generator=g).to(dtype) if bias else None
    A_log = torch.randn(hv, generator=g).to(dtype)
    dt_bias = torch.randn(hv, generator=g).to(dtype)
    to = (lambda t: None if t is None else t.to(device))
    wide_dev = to(wide.to(dtype))
    return (wide_dev[:, :C], to(ab)[:, :hv], to(ab)[:, hv:2 * hv], to(state), to(slots), to(w), to(cb), to(A_log),
            to(dt_bias)), (mixed, b, a)


@pytest.mark.parametrize("B,hk,dk,hv,dv,K,bias", [
    (3, 2, 16, 4, 8, 4, False),
    (1, 1, 24, 3, 20, 3, True),      # not powers of two, one row
    (5, 4, 32, 8, 32, 4, True),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("elsewhere", [False, True])
def test_post_conv_decode_kernel_matches_reference(device, B, hk, dk, hv, dv, K, bias, dtype, elsewhere):
    """The one-launch decode path (conv-state shift + conv + SiLU + split + L2 norm + g, beta)
    on row-strided views of a packed projection output, slots scattered over a larger pool:
    the same q, k, v, g, beta and conv states as the reference, other slots untouched; with
    ``elsewhere`` the shifted states go to other rows (the runner's look-ahead) and the rows
    read stay as they were."""
    args, _ = _post_conv_inputs(B, hk, dk, hv, dv, K, dtype, bias, device)
    mixed, b, a, state, slots, w, cb, A_log, dt_bias = args
    ref_state, before = state.clone(), state.clone()
    free = [r for r in range(state.shape[0]) if r not in slots.tolist()]
    dst = torch.tensor(free[:B], dtype=torch.int32, device=state.device) if elsewhere else None
    out = post_conv.post_conv_decode_triton(mixed, a, b, state, slots, w, cb, A_log, dt_bias, hk, dk, hv, dv, dst)
    ref = reference_post_conv_decode(mixed, a, b, ref_state, slots, w, cb, A_log, dt_bias, hk, dk, hv, dv, dst)
    if elsewhere:
        assert torch.equal(state[slots.long()], before[slots.long()])
        assert not torch.equal(state[dst.long()], before[dst.long()])
    for name, o, r in zip(("q", "k", "v", "g", "beta"), out, ref):
        assert o.dtype == r.dtype and o.shape == r.shape, name
        if o.dtype == torch.float32:
            torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5, msg=name)
        else:
            assert_close_ulps(o, r, ulps=1, mean_ulps=0.25, what=name)
    assert torch.equal(state, ref_state)


@pytest.mark.parametrize("B,hk,dk,hv,dv", [
    (3, 2, 16, 4, 8),
    (1, 1, 24, 3, 20),       # not powers of two, one row
    (4, 2, 32, 8, 40),       # four value heads a key head; dv over several column blocks
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("elsewhere", [False, True])
def test_recurrent_decode_kernel_matches_reference(device, B, hk, dk, hv, dv, dtype, elsewhere):
    """The in-place recurrent rule: each row's state read and written in its slot of a larger
    pool (the other slots untouched), value head j on key head j // (Hv / Hk): the reference's
    outputs and states. ``elsewhere``: the new states written to other rows (the runner's
    look-ahead), the rows read left as they were."""
    q, k, v, decay, beta, _ = _rule_inputs([1] * B, hk, hv, dk, dv, seed=5)
    gen = torch.Generator().manual_seed(6)
    pool = torch.randn(2 * B + 4, hv, dk, dv, generator=gen)
    perm = torch.randperm(2 * B + 4, generator=gen).to(torch.int32)
    slots = perm[:B]
    dst = perm[B:2 * B] if elsewhere else slots
    qn, kn = gdn.reference_l2norm(q).to(dtype), gdn.reference_l2norm(k).to(dtype)
    args = [t.to(device) for t in (qn, kn, v.to(dtype), decay, beta)]
    state, ref_state = pool.to(device), pool.clone()
    o = recurrent.recurrent_decode_triton(*args, state, slots.to(device), None, dst.to(device))
    ref = gdn.gated_delta_rule_decode(qn, kn, v.to(dtype), decay, beta, ref_state, slots, dst_slots=dst,
                                      reference=True)
    assert o.dtype == dtype and o.shape == (B, hv, dv)
    if dtype == torch.float32:
        torch.testing.assert_close(o.cpu(), ref, atol=1e-5, rtol=1e-5)
    else:
        assert_close_ulps(o, ref, ulps=1, mean_ulps=0.25, what="o")
    torch.testing.assert_close(state.cpu(), ref_state, atol=1e-5, rtol=1e-5)
    others = torch.ones(2 * B + 4, dtype=torch.bool)
    others[dst.long()] = False
    assert torch.equal(state.cpu()[others], pool[others])   # (with ``elsewhere``: the rows read too)


def test_recurrent_decode_kernel_compiles_for_sm90():
    """The recurrent kernel compiles for sm_90 at the published models' head sizes without
    spills (its state tile lives in registers)."""
    assert_gdn_sm90_no_spills("print_recurrent_sm90", {"qwen3_next", "qwen3_5_397b"})


def test_decode_entry_points_equal_prefill_of_one_token():
    """Through the package entry points on this device's path: a pure-decode step (post-conv +
    recurrent rule) gives what the prefill path (varlen conv + chunked rule) gives for the same
    one-token sequences, states included."""
    hk, dk, hv, dv, K, B = 2, 16, 4, 8, 4, 3
    (mixed, b, a, cstate, slots, w, cb, A_log, dt_bias), _ = _post_conv_inputs(B, hk, dk, hv, dv, K, torch.float32,
                                                                                True, "cpu")
    rstate = torch.randn(cstate.shape[0], hv, dk, dv)
    c2, r2 = cstate.clone(), rstate.clone()
    q, k, v, g, beta = gdn.post_conv_decode(mixed, a, b, cstate, slots, w, cb, A_log, dt_bias, hk, dk, hv, dv)
    o = gdn.gated_delta_rule_decode(q, k, v, g, beta, rstate, slots)
    cu = torch.arange(B + 1, dtype=torch.int32)
    ones = torch.ones(B, dtype=torch.bool)
    y = gdn.causal_conv1d_prefill(mixed, w, cb, c2, slots, ones, cu, (slots.tolist(), [True] * B, cu.tolist()))
    q2, k2, v2 = gdn.split_qkv(y, hk, dk, hv, dv)
    g2, beta2 = gdn.reference_gdn_gates(a, b, A_log, dt_bias)
    o2 = gdn.gated_delta_rule_prefill(q2, k2, v2, g2, beta2, r2, slots, ones, cu, cu.tolist())
    torch.testing.assert_close(o, o2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cstate, c2)
    torch.testing.assert_close(rstate, r2, atol=1e-5, rtol=1e-5)



def _fla_on_cpu(monkeypatch):
    """The CUDA branches of gdn's rule entry points, run on the CPU: fla-core's real signatures
    take our arguments (``inspect.Signature.bind``: a positional argument landing on the wrong
    parameter shows), and fla's own torch rule (fla.ops.gated_delta_rule.naive, the library
    authors' definition, GVA as their kernels map it: value head h reads key head h // (HV / H))
    computes what the kernel would."""
    import inspect
    fla_gdr = pytest.importorskip("fla.ops.gated_delta_rule")
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule as naive

    def bound(fn, args, kwargs):
        b = inspect.signature(fn).bind(*args, **kwargs)
        b.apply_defaults()
        p = b.arguments
        for name in ("gk", "gv", "A_log", "dt_bias"):  # gates we never pass
            assert p.get(name) is None, f"{fn.__name__}: {name} got a tensor"
        assert not p.get("use_gate_in_kernel") and not p["use_beta_sigmoid_in_kernel"] and not p["state_v_first"]
        return p

    def rule(p, s, e, h0):
        q, k, v = p["q"][:, s:e], p["k"][:, s:e], p["v"][:, s:e]
        if p["use_qk_l2norm_in_kernel"]:
            q, k = (torch.nn.functional.normalize(t.float(), dim=-1, eps=1e-6) for t in (q, k))
        rep = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
        return naive(q, k, v, beta=p["beta"][:, s:e], g=p["g"][:, s:e], scale=p["scale"], initial_state=h0,
                     output_final_state=True)

    def chunk(*args, **kwargs):
        p = bound(fla_gdr.chunk_gated_delta_rule, args, kwargs)
        cu = p["cu_seqlens"].tolist()
        outs, finals = [], []
        for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
            o, h = rule(p, s, e, p["initial_state"][n:n + 1])
            outs.append(o)
            finals.append(h)
        return torch.cat(outs, 1).to(p["v"].dtype), torch.cat(finals)

    monkeypatch.setattr(gdn, "_on_gpu", lambda t, reference: not reference)
    monkeypatch.setattr(gdn, "fla_ops", lambda: (chunk, None))


def test_fla_rule_calls_bind_to_fla_signatures(monkeypatch, device):
    """Our call of fla-core's chunked rule (the CUDA prefill path, here fla's torch definition in
    its place) passes each tensor to the parameter that means it and gives what our torch
    reference gives: fp32 inputs, GVA (2 key heads, 4 value heads), varlen with and without
    initial states; the decode step after it (our recurrent kernel: interpreted on a CPU,
    compiled on a GPU) continues from the states it wrote."""
    _fla_on_cpu(monkeypatch)
    hk, hv, dk, dv = 2, 4, 16, 8
    lengths = [5, 1, 9]
    q, k, v, g, beta, h0 = (t.to(device) for t in _rule_inputs(lengths, hk, hv, dk, dv, seed=3))
    cu_host, N = _cu(lengths), len(lengths)
    cu = torch.tensor(cu_host, dtype=torch.int32, device=device)
    slots = torch.tensor([2, 0, 3], dtype=torch.int32, device=device)
    has = torch.tensor([True, False, True], device=device)
    state = torch.cat([h0, h0[:1]])
    outs = []
    for reference in (False, True):
        st = state.clone()
        o = gdn.gated_delta_rule_prefill(q, k, v, g, beta, st, slots, has, cu, cu_host, reference=reference)
        qn, kn = gdn.reference_l2norm(q[:N]), gdn.reference_l2norm(k[:N])
        o2 = gdn.gated_delta_rule_decode(qn, kn, v[:N], g[:N], beta[:N], st, slots, reference=reference)
        outs.append((o, o2, st))
    for got, want, name in zip(outs[0], outs[1], ("prefill", "decode", "states")):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_fla_paths_match_references_on_gpu(dtype):
    """CUDA: the fla-core prefill conv and chunked rule, and the decode post-conv kernel + fla
    recurrent rule, against the torch references on the same inputs (slots, initial states)."""
    dev = "cuda"
    hk, dk, hv, dv, K = 2, 128, 4, 128, 4
    lengths = [37, 1, 130, 64]
    cu_host = _cu(lengths)
    N, T, C = len(lengths), cu_host[-1], 2 * hk * dk + hv * dv
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, C, generator=gen).to(dev, dtype)
    w = (torch.randn(C, K, generator=gen) * 0.5).to(dev, dtype)
    cstate = torch.randn(N + 2, K - 1, C, generator=gen).to(dev, dtype)
    rstate = torch.randn(N + 2, hv, dk, dv, generator=gen).to(dev)
    slots = torch.tensor([3, 0, 5, 1], device=dev, dtype=torch.int32)
    has = torch.tensor([True, False, True, True], device=dev)
    cu = torch.tensor(cu_host, device=dev, dtype=torch.int32)
    host = (slots.tolist(), has.tolist(), cu_host)
    c_ref, r_ref = cstate.clone(), rstate.clone()
    y = gdn.causal_conv1d_prefill(x, w, None, cstate, slots, has, cu, host)
    y_ref = gdn.causal_conv1d_prefill(x, w, None, c_ref, slots, has, cu, host, reference=True)
    assert_close_ulps(y, y_ref, ulps=2, mean_ulps=0.5, what="conv")
    assert torch.equal(cstate, c_ref)
    q, k, v = gdn.split_qkv(y_ref, hk, dk, hv, dv)
    g = -torch.rand(T, hv, generator=gen).to(dev)
    beta = torch.rand(T, hv, generator=gen).to(dev)
    o = gdn.gated_delta_rule_prefill(q, k, v, g, beta, rstate, slots, has, cu, cu_host)
    o_ref = gdn.gated_delta_rule_prefill(q, k, v, g, beta, r_ref, slots, has, cu, cu_host, reference=True)
    # errors against the outputs' own scale (these outputs are small: their largest is about 0.27,
    # so a fixed atol of 2e-2 hid a wrong decode rule); fla's chunked rule keeps bf16 operands
    _close_to_scale(o, o_ref, 0.03, "prefill outputs")
    _close_to_scale(rstate, r_ref, 0.02, "prefill states")
    # the decode step from one state for both (the prefill's states differ by rounding, which a
    # decode over dk = 128 would add to its own error)
    rstate.copy_(r_ref)
    qn, kn = gdn.reference_l2norm(q[:N]).to(dtype), gdn.reference_l2norm(k[:N]).to(dtype)
    o = gdn.gated_delta_rule_decode(qn, kn, v[:N], g[:N], beta[:N], rstate, slots)
    o_ref = gdn.gated_delta_rule_decode(qn, kn, v[:N], g[:N], beta[:N], r_ref, slots, reference=True)
    # fp32 arithmetic on the same bf16 inputs on both sides: bf16 rounding of the outputs only
    _close_to_scale(o, o_ref, 0.01, "decode outputs")
    _close_to_scale(rstate, r_ref, 1e-3, "decode states")


def _close_to_scale(got, want, frac, what):
    err, scale = (got.float() - want.float()).abs().max().item(), want.float().abs().max().item()
    assert err <= frac * scale, f"{what}: largest error {err:.3g}, {err / scale:.2%} of the largest value {scale:.3g}"


def test_post_conv_kernel_compiles_for_sm90():
    """The decode post-conv kernel compiles for sm_90 (the stand-in driver of
    tools/ptxas_check.py) at the published models' head sizes, without spills, and where dk != dv
    (a CUDA compile error once that the interpreter does not raise)."""
    assert_gdn_sm90_no_spills("print_post_conv_sm90", {"qwen3_next", "qwen3_5_397b", "dk_ne_dv"})
