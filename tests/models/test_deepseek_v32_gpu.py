"""DeepSeek-V3.2 on CUDA (skipped without a GPU): the indexer prep and logits, top-k and sparse MLA
Triton kernels inside the decode CUDA graphs and in prefill, against transformers on tiny
checkpoints (within the oracle's range, see tests/models/test_deepseek_v32.py), against the
engine's own chunked and token-by-token runs on long prompts, and against the forced-reference
engine (BLITZ_REFERENCE=1) on the bf16 preset past index_topk; the three kernels replayed from a
CUDA graph with new inputs."""
import pytest
import torch

from blitzllm import LLM, SamplingParams
from tests.models.test_deepseek_v32 import _all_free, _prompts, engine_logits, hf_decode, make_tiny_v32, stable_topk

pytestmark = pytest.mark.gpu


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts of the Triton launchers the model's ops dispatched to."""
    from blitzllm.kernels.attention import indexer, sparse_mla, topk
    calls = {}
    for mod, name in ((indexer, "indexer_prep_triton"), (indexer, "indexer_logits_triton"),
                      (topk, "topk_triton"), (sparse_mla, "sparse_mla_triton")):
        orig = getattr(mod, name)

        def counted(*a, _orig=orig, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _orig(*a, **kw)
        monkeypatch.setattr(mod, name, counted)
    return calls


def test_cuda_graphs_and_kernels_match_transformers(tmp_path, kernel_calls):
    """fp32 tiny checkpoint, decode through the CUDA graphs (captured past index_topk, so every
    graph runs the sparse path): prompts up to index_topk then 40 steps, batched, give
    transformers' greedy tokens and step logprobs (2e-3); no leaks."""
    hf = make_tiny_v32(tmp_path, seed=1).to("cuda")
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_blocks=64, max_num_seqs=4, max_model_len=128)
    assert llm.engine.runner.graphs is not None
    prompts = _prompts((1, 5, 8))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0))
    for prompt, out in zip(prompts, outs):
        tokens, lp = hf_decode(hf, prompt, 40)
        assert out.token_ids == tokens
        ours = torch.tensor([d[t] for d, t in zip(out.logprobs, out.token_ids)])
        torch.testing.assert_close(ours, lp[torch.arange(40), torch.tensor(tokens)].cpu(), atol=2e-3, rtol=0)
    assert _all_free(llm)
    assert all(kernel_calls.get(k) for k in ("indexer_prep_triton", "indexer_logits_triton", "topk_triton",
                                             "sparse_mla_triton")), kernel_calls


def test_long_prompts_on_cuda(tmp_path, kernel_calls):
    """Prompts 4x index_topk and more, fp32: the Triton prefill rows (one shot, 7-token chunks,
    token by token) give the logits of transformers with a tie-stable top-k (2e-3)."""
    hf = make_tiny_v32(tmp_path, seed=2).to("cuda")
    for prompt in _prompts((32, 45), seed=5):
        with torch.no_grad(), stable_topk():
            ref = hf(torch.tensor([prompt], device="cuda")).logits[0].float()
        for chunk in (len(prompt), 7, 1):
            llm = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_blocks=16, block_size=4,
                      enforce_eager=True)
            torch.testing.assert_close(engine_logits(llm, prompt, chunk), ref, atol=2e-3, rtol=0, msg=f"chunk {chunk}")
    assert kernel_calls.get("sparse_mla_triton")


def test_bf16_preset_matches_the_reference_engine(monkeypatch):
    """The deepseek-v3.2 preset (dummy weights, 4 layers: 3 dense + 1 MoE) in bf16 with prompts past
    index_topk (2048): CUDA graphs and Triton kernels agree with the forced-reference engine step
    by step (tests/gpu_parity.py), batched and in 512-token prefill chunks."""
    from tests.gpu_parity import BF16_TOL, assert_runs_agree
    from tests.test_gpu_e2e import _reference
    kw = dict(num_layers=4, device="cuda", dtype="bfloat16", kv_cache_blocks=640, max_num_seqs=4,
              max_model_len=4096)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(100, 120000, (n,), generator=g).tolist() for n in (3, 2100, 2600)]
    fast = LLM("preset:deepseek-v3.2", max_num_batched_tokens=512, **kw)
    assert fast.engine.runner.graphs is not None
    got = fast.generate(prompts, params)
    assert _all_free(fast)
    del fast
    torch.cuda.empty_cache()
    ref = _reference(monkeypatch, "preset:deepseek-v3.2", **kw)
    # (the reference is the engine alive: at a near-tie fork it restarts on the fast path's tokens)
    assert_runs_agree(ref, prompts, ref.generate(prompts, params), got, params, tol=BF16_TOL)


def test_sparse_kernels_replay_from_a_cuda_graph():
    """Indexer logits -> top-k -> sparse MLA captured once in a CUDA graph (fixed launches, no host
    sync), replayed after the lengths, tables and caches changed in place: the references' results."""
    from blitzllm.kernels.attention import indexer as ix, sparse_mla as sm, topk as tk
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    B, H, D, bs, W, K, h, r, p = 3, 64, 128, 64, 80, 2048, 16, 512, 64
    keys = torch.randn(W * B, bs, 1, D, device=dev, dtype=bf)
    lat = torch.randn(W * B, bs, 1, r + p, device=dev, dtype=bf)
    q, w = torch.randn(B, H, D, device=dev, dtype=bf), torch.randn(B, H, device=dev)
    ql, qr = torch.randn(B, h, r, device=dev, dtype=bf), torch.randn(B, h, p, device=dev, dtype=bf)
    tables = torch.zeros(B, W, dtype=torch.int32, device=dev)
    lens = torch.ones(B, dtype=torch.int32, device=dev)

    def step():
        logits = ix.indexer_logits(q, w, keys, tables, lens, W * bs)
        idx = tk.topk(logits, lens, K)
        return logits, idx, sm.sparse_mla(ql, qr, lat, tables, idx, 0.05)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits, idx, out = step()
    for n in ([5000, 1, 2048], [W * bs, 2049, 300]):
        tables.copy_(torch.stack([torch.randperm(W * B, device=dev)[:W] for _ in range(B)]).int())
        lens.copy_(torch.tensor(n, dtype=torch.int32))
        keys.normal_()
        lat.normal_()
        graph.replay()
        torch.cuda.synchronize()
        ref_logits = ix.reference_indexer_logits(q, w, keys, tables, lens, W * bs)
        valid = torch.isfinite(ref_logits)
        torch.testing.assert_close(logits[valid], ref_logits[valid], atol=1e-2, rtol=1e-2)
        assert torch.equal(idx, tk.reference_topk(logits.masked_fill(~valid, float("-inf")), lens, K))
        torch.testing.assert_close(out.float(), sm.reference_sparse_mla(ql, qr, lat, tables, idx, 0.05).float(),
                                   atol=2.5e-2, rtol=2.5e-2)
