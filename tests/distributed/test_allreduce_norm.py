"""The collectives of a tensor-parallel forward, on two gloo ranks, against plain torch:
the fused all-reduce + residual add + RMSNorm (with and without a residual) and the
full-width q/k norm from all-reduced sums of squares (KV heads split, and one KV head
replicated on both ranks). The one-shot workspace's glue (buffer, pointer table, kernel,
start-up check against the collective) on a world of one rank."""
import multiprocessing as mp
import socket

import torch

from blitzllm.kernels.norm.allreduce_rmsnorm import reference_allreduce_add_rms_norm
from blitzllm.kernels.norm.rmsnorm import reference_rms_norm

T, N, D, HQ = 5, 48, 8, 4
EPS = 1e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(rank: int):
    """Rank ``rank``'s partial sums, and what every rank shares (residual, weight)."""
    shared = torch.Generator().manual_seed(0)
    residual, weight = torch.randn(T, N, generator=shared) * 2, 1 + 0.3 * torch.randn(N, generator=shared)
    own = torch.Generator().manual_seed(10 + rank)
    return torch.randn(T, N, generator=own), residual, weight


def _qk(hkv: int):
    """Full q [T, HQ * D], k, v [T, hkv * D] and the full-width norm weights."""
    g = torch.Generator().manual_seed(hkv)
    q, k, v = (torch.randn(T, h * D, generator=g) * 3 for h in (HQ, hkv, hkv))
    return q, k, v, 1 + 0.3 * torch.randn(HQ * D, generator=g), 1 + 0.3 * torch.randn(hkv * D, generator=g)


@torch.no_grad()
def _rank_main(rank: int, port: int, out_dir: str) -> None:
    from blitzllm.distributed.allreduce_norm import all_reduce_add_rms_norm, full_width_qk_norm
    from blitzllm.distributed.parallel_state import (WorldEnv, connect_store, destroy_tp_group, init_tp_group,
                                                     split_heads)
    from blitzllm.layers.norm import RMSNorm
    env = WorldEnv(rank, 2, rank, "127.0.0.1", port)
    group = init_tp_group(env, connect_store(env, 60), torch.device("cpu"))
    x, residual, weight = _inputs(rank)
    res = {"with_residual": all_reduce_add_rms_norm(x.clone(), residual, weight, EPS, group),
           "first_layer": all_reduce_add_rms_norm(x.clone(), None, weight, EPS, group)}
    for hkv in (2, 1):
        q, k, v, wq, wk = _qk(hkv)
        h = split_heads(HQ, hkv, group)
        qs, ks = slice(h.q_start * D, (h.q_start + h.num_heads) * D), slice(h.kv_start * D, (h.kv_start + 1) * D)
        qn, kn = RMSNorm(h.num_heads * D, EPS), RMSNorm(D, EPS)
        qn.weight.data, kn.weight.data = wq[qs], wk[ks]
        qkv = torch.cat([q[:, qs], k[:, ks], v[:, ks]], 1)
        res[f"qk_kv{hkv}"] = (full_width_qk_norm(qkv, qn, kn, h, D, group), qs, ks)
    torch.save(res, f"{out_dir}/rank{rank}.pt")
    destroy_tp_group()


def test_fused_all_reduce_norm_and_full_width_qk_norm_on_gloo(tmp_path):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    out = {r: torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)}
    partials = [_inputs(r)[0] for r in (0, 1)]
    _, residual, weight = _inputs(0)
    for name, res in (("with_residual", residual), ("first_layer", None)):
        ref_out, ref_res = reference_allreduce_add_rms_norm(partials, res, weight, EPS)
        for r in (0, 1):
            got_out, got_res = out[r][name]
            torch.testing.assert_close(got_res, ref_res, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(got_out, ref_out, atol=1e-5, rtol=1e-5)
        assert torch.equal(out[0][name][0], out[1][name][0])  # every rank holds the same result
    for hkv in (2, 1):
        q, k, v, wq, wk = _qk(hkv)
        ref_q, ref_k = reference_rms_norm(q, wq, EPS), reference_rms_norm(k, wk, EPS)
        for r in (0, 1):
            got, qs, ks = out[r][f"qk_kv{hkv}"]
            nq = qs.stop - qs.start
            torch.testing.assert_close(got[:, :nq], ref_q[:, qs], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got[:, nq:nq + D], ref_k[:, ks], atol=1e-5, rtol=1e-5)
            assert torch.equal(got[:, nq + D:], v[:, ks])


class _NoBarrier:
    """A one-rank world has nobody to wait for (on CPU there is no symmetric memory)."""

    def barrier(self, channel=0, timeout_ms=0):
        pass


def test_oneshot_workspace_on_one_rank():
    from blitzllm.distributed.allreduce_norm import OneShotWorkspace, all_reduce_add_rms_norm
    from blitzllm.distributed.parallel_state import WorldEnv, connect_store, destroy_tp_group, init_tp_group
    from blitzllm.kernels.norm.rmsnorm import fused_add_rms_norm
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    env = WorldEnv(0, 1, 0, "127.0.0.1", _free_port())
    group = init_tp_group(env, connect_store(env, 60), dev)
    try:
        if cuda:  # the real thing: symmetric memory, made and checked at start-up
            ws = group.oneshot
            assert ws is not None
        else:
            buf = torch.zeros(64 << 10, dtype=torch.uint8)
            ws = OneShotWorkspace(buf, _NoBarrier(), torch.tensor([buf.data_ptr()], dtype=torch.int64))
            assert ws.agrees_with_nccl(group)
        x, r = torch.randn(7, 96, device=dev), torch.randn(7, 96, device=dev)
        w = torch.rand(96, device=dev) + 0.5
        out, res = ws.all_reduce_rms_norm(x, r, w, 1e-6)
        ref_out, ref_res = fused_add_rms_norm(x, r, w, 1e-6)
        torch.testing.assert_close(res, ref_res)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        if cuda:
            assert ws.fits(x)
            torch.testing.assert_close(all_reduce_add_rms_norm(x, r, w, 1e-6, group)[0], ref_out, atol=1e-5, rtol=1e-5)
    finally:
        destroy_tp_group()
