"""Tensor parallelism on the CPU (gloo, two processes): tensor_parallel_size=2 gives the
greedy tokens (and logprobs) of tensor_parallel_size=1 on tiny dense, MoE and MLA
checkpoints; a rank holds exactly its slices of the checkpoint; workers stop with the
engine; a killed worker fails the engine within a bounded time instead of hanging it."""
import os
import signal
import threading
import time

import pytest
import torch

from blitzllm import LLM, SamplingParams
from blitzllm.config import ModelConfig
from blitzllm.engine.tp import TPWorkerError
from blitzllm.distributed.parallel_state import TPGroup
from blitzllm.loader.source import resolve_model
from blitzllm.runner.build import build_model
from tests.conftest import make_tiny_checkpoint
from tests.models.test_deepseek_v3 import make_tiny_deepseek
from tests.models.test_moe_models import make_moe_checkpoint

KW = dict(device="cpu", dtype="float32", kv_cache_blocks=64)
LENGTHS = (1, 5, 17, 40)


def _prompts(seed: int = 7) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in LENGTHS]


def check_tp_matches_single(path, n: int = 12, check=None, **kw) -> None:
    """Greedy tokens of TP=2 equal TP=1's; logprobs agree to float32 summation order.
    ``check``: called with the TP=2 engine's rank-0 model."""
    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    prompts = _prompts()
    ref = LLM(str(path), **KW, **kw).generate(prompts, p)
    with LLM(str(path), **KW, **kw, tensor_parallel_size=2) as llm:
        outs = llm.generate(prompts, p)
        assert llm.stats()["kv_blocks_free"] == 64
        if check is not None:
            check(llm.engine.runner.model)
        procs = [proc for _, proc in llm.engine.tp.procs]
    for a, b in zip(ref, outs):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        lp_a = torch.tensor([lp[t] for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)])
        lp_b = torch.tensor([lp[t] for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)])
        torch.testing.assert_close(lp_b, lp_a, atol=1e-4, rtol=1e-4)
    assert len({t for o in ref for t in o.outputs[0].token_ids}) > 4  # not a degenerate output
    assert procs and all(p.exitcode == 0 for p in procs)  # the workers stopped with the engine


@pytest.mark.parametrize("arch,overrides", [
    # one KV head for two ranks (replicated), a vocabulary that does not split evenly, tied lm_head
    ("llama", dict(num_key_value_heads=1, vocab_size=321, tie_word_embeddings=True)),
    ("qwen2", dict()),  # q/k/v bias on the column-parallel projection, KV heads split
])
def test_dense_tp2_matches_tp1(tmp_path, arch, overrides):
    make_tiny_checkpoint(arch, tmp_path, seed=1, **overrides)
    check_tp_matches_single(tmp_path)


def test_qwen3_moe_tp2_matches_tp1(tmp_path):
    """Experts split by expert (their I / 2 = 16 rows are thin), a dense layer split by tensor."""
    make_moe_checkpoint("qwen3_moe", tmp_path, seed=1, mlp_only_layers=[2])
    check_tp_matches_single(tmp_path)


def test_minimax_m2_tp2_matches_tp1(tmp_path, monkeypatch):
    """Experts split by tensor; the full-width q/k norm from all-reduced sums of squares,
    with the single KV head replicated on both ranks."""
    monkeypatch.setenv("BLITZ_MOE_SPLIT", "tensor")
    make_moe_checkpoint("minimax_m2", tmp_path, seed=2, num_key_value_heads=1)
    check_tp_matches_single(tmp_path)


@pytest.mark.parametrize("variant", [
    dict(attention_bias=True),  # q LoRA, YaRN; o_proj bias added by rank 0 only
    dict(q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=1,
         rope_parameters=dict(rope_type="default", rope_theta=10000.0)),  # q_proj rows packed with the latent
])
def test_deepseek_v3_tp2_matches_tp1(tmp_path, variant):
    make_tiny_deepseek(tmp_path, seed=1, **variant)
    check_tp_matches_single(tmp_path)


def test_fp8_weights_tp2_matches_tp1(tmp_path):
    """weight_dtype='fp8' on an FP8 checkpoint whose 16 x 16 blocks align with every rank's part:
    each rank quantizes its part again on the checkpoint's grid, so both ranks together hold
    exactly the single rank's values, and TP=2 gives TP=1's tokens and logprobs."""
    from tests.models.test_fp8_checkpoints import quantize_checkpoint
    make_moe_checkpoint("qwen3_moe", tmp_path, seed=1, mlp_only_layers=[2])
    quantize_checkpoint(tmp_path, block=(16, 16))

    def rank0_holds_fp8_halves(model):
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight.shape == (64, 64)  # (128 rows split)
        assert qkv.fp8_block == (16, 16) and qkv.weight_scale_inv.shape == (4, 4)

    check_tp_matches_single(tmp_path, check=rank0_holds_fp8_halves, weight_dtype="fp8")


def test_awq_checkpoint_tp2_matches_tp1(tmp_path):
    """An AWQ checkpoint (every linear layer and expert in 4-bit codes): each rank dequantizes the
    whole weight as it streams in and keeps its part; TP=2 gives TP=1's tokens and logprobs."""
    from tests.models.test_quantized_checkpoints import awq_in_place
    make_moe_checkpoint("qwen3_moe", tmp_path, seed=1, mlp_only_layers=[2])
    awq_in_place(tmp_path)
    check_tp_matches_single(tmp_path)


# ---- sharded loading ------------------------------------------------------------------------

def _rank_model(path, rank: int):
    src = resolve_model(str(path))
    cfg = ModelConfig.from_hf(src.hf_config)
    return build_model(src, cfg, torch.device("cpu"), torch.float32, 0, tp=TPGroup(rank, 2))


def test_ranks_hold_their_slices(tmp_path):
    """Built for rank r of 2 (lazy safetensors slices), every sharded tensor is its half of
    the checkpoint's: q/k/v heads, o_proj columns, MLP rows / columns, vocabulary rows
    (padded with zeros), and the whole of what is replicated."""
    make_tiny_checkpoint("llama", tmp_path, seed=3, vocab_size=321)
    whole = _rank_model_single(tmp_path)
    for rank in (0, 1):
        part = dict(_rank_model(tmp_path, rank).named_parameters())
        pre = "model.layers.1."
        q, kv = 64 // 2, 32 // 2  # 4 heads / 2 KV heads of 16
        qkv = whole[pre + "self_attn.qkv_proj.weight"]
        expect = torch.cat([qkv[rank * q:(rank + 1) * q], qkv[64 + rank * kv:64 + (rank + 1) * kv],
                            qkv[96 + rank * kv:96 + (rank + 1) * kv]])
        assert torch.equal(part[pre + "self_attn.qkv_proj.weight"], expect)
        o_proj = whole[pre + "self_attn.o_proj.weight"]
        assert torch.equal(part[pre + "self_attn.o_proj.weight"], o_proj[:, rank * q:(rank + 1) * q])
        gu = whole[pre + "mlp.gate_up_proj.weight"]
        assert torch.equal(part[pre + "mlp.gate_up_proj.weight"],
                           torch.cat([gu[rank * 64:(rank + 1) * 64], gu[128 + rank * 64:128 + (rank + 1) * 64]]))
        down = whole[pre + "mlp.down_proj.weight"]
        assert torch.equal(part[pre + "mlp.down_proj.weight"], down[:, rank * 64:(rank + 1) * 64])
        for name in ("model.embed_tokens.weight", "lm_head.weight"):  # 321 rows: 161 + 160 and a zero row
            rows = whole[name][rank * 161:(rank + 1) * 161]
            assert torch.equal(part[name][:len(rows)], rows) and not part[name][len(rows):].any()
        assert torch.equal(part[pre + "input_layernorm.weight"], whole[pre + "input_layernorm.weight"])
        assert sum(p.numel() for p in part.values()) < 0.55 * sum(p.numel() for p in whole.values())


def test_gguf_rank_shard():
    """GGUF tensors arrive whole (dequantized) and are sliced: rank 1 of 3 of SmolLM2 (9
    query heads, 3 KV heads of 64) holds heads 3..5, KV head 1 and a third of the vocabulary."""
    src = resolve_model("smollm2")
    cfg = ModelConfig.from_hf(src.hf_config, num_layers=1)
    whole = dict(build_model(src, cfg, torch.device("cpu"), torch.float32, 0).named_parameters())
    part = dict(build_model(resolve_model("smollm2"), cfg, torch.device("cpu"), torch.float32, 0,
                            tp=TPGroup(1, 3)).named_parameters())
    qkv = whole["model.layers.0.self_attn.qkv_proj.weight"]  # 576 q rows, 192 k, 192 v
    assert torch.equal(part["model.layers.0.self_attn.qkv_proj.weight"],
                       torch.cat([qkv[192:384], qkv[576 + 64:576 + 128], qkv[768 + 64:768 + 128]]))
    assert torch.equal(part["model.layers.0.self_attn.o_proj.weight"],
                       whole["model.layers.0.self_attn.o_proj.weight"][:, 192:384])
    assert torch.equal(part["model.embed_tokens.weight"], whole["model.embed_tokens.weight"][16384:32768])


def test_single_rank_builds_plain_layers(tmp_path):
    """tensor_parallel_size=1: no process group, no parts to load, no reducing norms."""
    import torch.distributed as dist
    from torch import nn

    from blitzllm.layers.norm import RMSNorm
    make_moe_checkpoint("qwen3_moe", tmp_path, seed=5)
    model = LLM(str(tmp_path), **KW).engine.runner.model
    assert not dist.is_initialized()
    assert type(model.model.embed_tokens) is nn.Embedding
    assert not any(hasattr(m, "tp_parts") for m in model.modules())
    assert all(m.tp is None for m in model.modules() if isinstance(m, RMSNorm))
    assert all(m.expert_start is None for m in model.modules() if hasattr(m, "expert_start"))


def test_experts_split_by_expert_and_by_tensor(tmp_path, monkeypatch):
    make_moe_checkpoint("qwen3_moe", tmp_path, seed=4)
    whole = _rank_model_single(tmp_path)
    moe = "model.layers.0.mlp."
    r1 = dict(_rank_model(tmp_path, 1).named_parameters())  # by expert: experts 4..7 whole
    assert torch.equal(r1[moe + "w13"], whole[moe + "w13"][4:])
    assert torch.equal(r1[moe + "w2"], whole[moe + "w2"][4:])
    assert torch.equal(r1[moe + "gate.weight"], whole[moe + "gate.weight"])
    monkeypatch.setenv("BLITZ_MOE_SPLIT", "tensor")
    r1 = dict(_rank_model(tmp_path, 1).named_parameters())  # by tensor: I rows 16..31 of every expert
    w13 = whole[moe + "w13"]
    assert torch.equal(r1[moe + "w13"], torch.cat([w13[:, 16:32], w13[:, 48:64]], 1))
    assert torch.equal(r1[moe + "w2"], whole[moe + "w2"][:, :, 16:32])


def _rank_model_single(path) -> dict:
    src = resolve_model(str(path))
    return dict(build_model(src, ModelConfig.from_hf(src.hf_config), torch.device("cpu"), torch.float32, 0)
                .named_parameters())


def test_unshardable_model_is_a_user_error(tmp_path):
    make_tiny_checkpoint("llama", tmp_path, seed=5, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="num_attention_heads .4. must be divisible by tensor_parallel_size .3."):
        LLM(str(tmp_path), **KW, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(str(tmp_path), **KW, tensor_parallel_size=0)


def test_start_up_error_stops_the_workers(tmp_path):
    """An error found on rank 0 after the workers started (here a max_model_len beyond
    the KV cache) is the user's ValueError, and the workers stop cleanly."""
    import multiprocessing
    make_tiny_checkpoint("llama", tmp_path, seed=5)
    with pytest.raises(ValueError, match="exceeds the KV cache capacity"):
        LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=4, max_model_len=256,
            tensor_parallel_size=2)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("blitz-tp")]


# ---- failures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-llama")
    make_tiny_checkpoint("llama", path, seed=6)
    return path


def test_killed_idle_worker_fails_the_next_step(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), **KW, tensor_parallel_size=2)
    try:
        eng = llm.engine
        eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
        eng.step()
        (_, proc), = eng.tp.procs
        environ = open(f"/proc/{proc.pid}/environ", "rb").read().split(b"\0")
        for var in (b"NCCL_NVLS_ENABLE=0", b"TORCH_SYMM_MEM_DISABLE_MULTICAST=1", b"NVSHMEM_DISABLE_NVLS=1"):
            assert var in environ  # the multi-GPU settings reach every spawned rank
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TPWorkerError, match="rank 1 .* died"):
            for _ in range(100):
                eng.step()
        assert time.monotonic() - t0 < 10
        with pytest.raises(TPWorkerError):  # and stays failed
            eng.step()
    finally:
        llm.close()


def test_worker_killed_mid_generation_raises_within_bounded_time(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), **KW, tensor_parallel_size=2)
    try:
        (_, proc), = llm.engine.tp.procs
        killer = threading.Timer(0.5, os.kill, (proc.pid, signal.SIGKILL))
        prompts = [list(range(3, 3 + n)) for n in (40, 60, 80, 100)]
        t0 = time.monotonic()
        killer.start()
        with pytest.raises(TPWorkerError, match="worker rank 1"):
            llm.generate(prompts, SamplingParams(max_tokens=400, ignore_eos=True))
        assert time.monotonic() - t0 < 30
    finally:
        killer.cancel()
        llm.close()


def test_embed_tp2_matches_tp1(tiny_llama_path):
    """Embeddings under tensor parallelism: rank 0 pools the final hidden rows alone (the final
    norm all-reduced them, so they are whole); chunked (budget 16), beside a generation, the
    vectors equal TP=1's to float32 summation order and the blocks all come back."""
    from blitzllm import PoolingParams
    prompts = _prompts()
    kw = dict(KW, max_num_batched_tokens=16, pooler_config={"pooling_type": "MEAN"})
    ref = LLM(str(tiny_llama_path), **kw).embed(prompts, PoolingParams(normalize=False))
    with LLM(str(tiny_llama_path), **kw, tensor_parallel_size=2) as llm:
        e = llm.engine
        e.add_request("g", prompts[3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        e.step()
        outs = llm.embed(prompts, PoolingParams(normalize=False))
        while e.has_unfinished():
            e.step()
        assert llm.stats()["kv_blocks_free"] == 64
    for a, b in zip(ref, outs):
        torch.testing.assert_close(torch.tensor(b.outputs.embedding), torch.tensor(a.outputs.embedding),
                                   atol=1e-4, rtol=1e-4)


def test_prompt_embeds_tp2_match_tp1(tiny_llama_path):
    """Prompt embeddings under tensor parallelism: rank 0's step broadcast carries their rows, which
    every rank puts in place of the placeholders' (vocabulary-parallel) embeddings; chunked (budget
    16) beside a token prompt, the tokens and logprobs equal TP=1's."""
    from safetensors.torch import load_file
    table = load_file(str(tiny_llama_path / "model.safetensors"))["model.embed_tokens.weight"]
    g = torch.Generator().manual_seed(3)
    embeds = [table[p] * 1.3 + 0.05 * torch.randn(len(p), table.shape[1], generator=g) for p in _prompts()[1:]]
    prompts = [{"prompt_embeds": e} for e in embeds] + [_prompts()[0]]
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    kw = dict(KW, max_num_batched_tokens=16, enable_prompt_embeds=True)
    ref = LLM(str(tiny_llama_path), **kw).generate(prompts, p)
    with LLM(str(tiny_llama_path), **kw, tensor_parallel_size=2) as llm:
        outs = llm.generate(prompts, p)
        assert llm.stats()["kv_blocks_free"] == 64
    for a, b in zip(ref, outs):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        torch.testing.assert_close(torch.tensor([lp[t] for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]),
                                   torch.tensor([lp[t] for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]),
                                   atol=1e-4, rtol=1e-4)


def test_classify_tp2_matches_transformers(tmp_path):
    """A sequence classifier under tensor parallelism: its score head is whole on every rank and
    rank 0 applies it to the pooled row; chunked (budget 16), the probabilities equal
    transformers' softmax and the blocks all come back."""
    from tests.classifiers import hf_logits, make_tiny_classifier
    hf = make_tiny_classifier("qwen3", tmp_path, 3)
    prompts = _prompts()
    with LLM(str(tmp_path), **KW, max_num_batched_tokens=16, tensor_parallel_size=2) as llm:
        outs = llm.classify(prompts)
        assert llm.stats()["kv_blocks_free"] == 64
    for p, o in zip(prompts, outs):
        torch.testing.assert_close(torch.tensor(o.outputs.probs), hf_logits(hf, p).softmax(-1), atol=1e-4, rtol=0)
