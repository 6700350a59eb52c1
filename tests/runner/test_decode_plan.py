"""The runner's decode plan (runner/decode_plan.py): which modules the kernel knobs mark, read
when the engine is built (envs.Knobs), and that every knob keeps the CPU path's outputs."""
import pytest
import torch

from blitzllm import LLM, SamplingParams
from blitzllm.envs import Knobs
from blitzllm.layers.linear import Linear
from blitzllm.runner.decode_plan import apply_decode_plan
from tests.models.test_moe_models import make_moe_checkpoint


def _greedy(llm):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (k,), generator=g).tolist() for k in (1, 6)]
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    make_moe_checkpoint("qwen3_moe", path, seed=2)
    return path


def _marks(model):
    layers = model.model.layers
    return dict(o_proj=[layer.self_attn.o_proj.tma_preload for layer in layers],
                early=[layer.self_attn.attn.preload_next == (layer.self_attn.o_proj,) for layer in layers],
                qkv=[layer.self_attn.qkv_proj.tma_preload for layer in layers],
                qkv_early=[layer.self_attn.qkv_proj.tma_early for layer in layers],
                lm_head=model.lm_head.tma_preload,
                gemv={m.use_gemv for m in model.modules() if isinstance(m, Linear)})


@pytest.mark.parametrize("mode,o_proj,qkv,early,lm_head", [
    ("1", True, True, True, False), ("o_proj", True, False, True, False), ("lm_head", True, True, True, True),
    ("nodeps", True, True, False, False), ("0", False, False, False, False)])
def test_gemv_tma_modes_mark_the_projections(moe_dir, monkeypatch, mode, o_proj, qkv, early, lm_head):
    monkeypatch.setenv("BLITZ_GEMV_TMA", mode)
    llm = LLM(str(moe_dir), device="cpu", kv_cache_blocks=64)
    m = _marks(llm.engine.runner.model)
    assert set(m["o_proj"]) == {o_proj} and set(m["qkv"]) == {qkv} and m["lm_head"] == lm_head
    assert set(m["early"]) == {early}
    if qkv:
        assert set(m["qkv_early"]) == {mode != "nodeps"}
    assert m["gemv"] == {True}


def test_knobs_are_read_per_engine_and_keep_the_outputs(moe_dir, monkeypatch):
    """Knobs come from the environment when an engine is built (not at import): an engine with
    the GEMV off and the greedy kernel off marks its modules so,
    the engine built before keeps its own, and on the CPU every knob gives the default tokens."""
    base = LLM(str(moe_dir), device="cpu", kv_cache_blocks=64)
    want = _greedy(base)
    monkeypatch.setenv("BLITZ_GEMV", "0")
    monkeypatch.setenv("BLITZ_GREEDY_KERNEL", "0")
    llm = LLM(str(moe_dir), device="cpu", kv_cache_blocks=64)
    m = _marks(llm.engine.runner.model)
    assert m["gemv"] == {False}
    assert llm.engine.runner.sampler.greedy_kernel is False
    assert _marks(base.engine.runner.model)["gemv"] == {True}  # the first engine is unchanged
    assert llm.engine.knobs == Knobs(gemv=False, greedy_kernel=False)
    assert _greedy(llm) == want


def test_reference_knob_marks_nothing_and_runs_eager(moe_dir, monkeypatch):
    """BLITZ_REFERENCE=1: no kernel form marked, the torch attention backend, no CUDA graphs,
    the same tokens on the CPU."""
    want = _greedy(LLM(str(moe_dir), device="cpu", kv_cache_blocks=64))
    monkeypatch.setenv("BLITZ_REFERENCE", "1")
    llm = LLM(str(moe_dir), device="cpu", kv_cache_blocks=64)
    m = _marks(llm.engine.runner.model)
    assert not any(m["o_proj"] + m["qkv"] + m["early"]) and m["gemv"] == {False}
    assert llm.engine.runner.backend.name == "torch" and llm.engine.runner.graphs is None
    assert _greedy(llm) == want


def test_moe_fp32_sums_go_where_a_norm_rounds_them(moe_dir):
    """Each MoE block returns its fp32 sum where the next op is a single-rank residual add +
    RMSNorm (the next layer's input norm or the final norm): every sparse layer of a one-rank
    Qwen3-MoE model."""
    llm = LLM(str(moe_dir), device="cpu", kv_cache_blocks=64)
    mlps = [getattr(layer, layer.mlp_name) for layer in llm.engine.runner.model.model.layers]
    moes = [m for m in mlps if hasattr(m, "fp32_sum")]
    assert moes and all(m.fp32_sum for m in moes)
    plain = LLM(str(moe_dir), device="cpu", kv_cache_blocks=64, tensor_parallel_size=1)
    model = plain.engine.runner.model
    for m in model.modules():
        if hasattr(m, "fp32_sum"):
            m.fp32_sum = False
    apply_decode_plan(model, Knobs())
    assert all(m.fp32_sum for m in model.modules() if hasattr(m, "fp32_sum"))


def test_hybrid_moe_blocks_return_fp32_sums(tmp_path):
    """The hybrid models' MoE blocks (Qwen3-Next) return their fp32 sums too: whether a gated
    delta net or an attention layer follows (both enter through ``Linear.forward_norm``, whose
    (1 + w) norm rounds the sum) or the final norm; the dense-MLP layer has none; greedy output
    unchanged against transformers (tests/models/test_qwen3_next.py's check)."""
    from blitzllm.models.qwen3_next import SharedExpertMoE
    from tests.models.test_qwen3_next import _llm, _prompts, check_generate, make_hybrid_checkpoint
    hf = make_hybrid_checkpoint("qwen3_next", tmp_path)
    llm = _llm(tmp_path)
    moes = [layer.mlp for layer in llm.engine.runner.model.model.layers if isinstance(layer.mlp, SharedExpertMoE)]
    assert len(moes) == 3 and all(m.fp32_sum for m in moes)
    check_generate(llm, hf, _prompts((1, 5, 17)), n=6)
