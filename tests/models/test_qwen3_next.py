"""Qwen3-Next and Qwen3.5 (hybrid gated delta net + gated attention) on the CPU reference
path: tiny random checkpoints written by transformers' save_pretrained (``qwen3_next``,
``qwen3_5_text``, ``qwen3_5_moe_text`` and a multimodal ``qwen3_5_moe`` folder) give
transformers' logits through prefill, chunked prefill and decode steps with the GDN states
in scattered slots; the (1 + w) norm; the presets' sizes."""
import pytest
import torch

from blitzllm.config import CacheConfig, ModelConfig
from blitzllm.layers.attention import ForwardContext, forward_context
from blitzllm.layers.norm import OffsetRMSNorm
from blitzllm.layers.state import StateMetadata, state_context
from blitzllm.loader.source import resolve_model
from blitzllm.models.registry import get_model_class
from blitzllm.runner.build import build_model
from blitzllm.runner.model_runner import ModelRunner

ARCHS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5_moe")
HYBRID = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.25, tie_word_embeddings=False,
              linear_num_key_heads=2, linear_key_head_dim=16, linear_num_value_heads=4, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, num_hidden_layers=4,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2)


def make_hybrid_checkpoint(arch: str, path, seed: int = 0, **overrides):
    """A tiny random checkpoint written by save_pretrained (fp32); norm weights random too
    (transformers initialises the (1 + w) norms' w to 0 and the gated norm's to 1)."""
    import transformers
    torch.manual_seed(seed)
    text = dict(HYBRID, **overrides)
    if arch == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(**dict(MOE, intermediate_size=96, mlp_only_layers=[2], **text))
        model = transformers.Qwen3NextForCausalLM(cfg)
    elif arch == "qwen3_5_text":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(intermediate_size=96, **text))
    elif arch == "qwen3_5_moe_text":
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**dict(MOE, **text)))
    elif arch == "qwen3_5_moe":
        cfg = transformers.Qwen3_5MoeConfig(text_config=dict(MOE, **text), vision_config=VISION)
        model = transformers.Qwen3_5MoeForConditionalGeneration(cfg)
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("linear_attn.norm.weight"):
                t.normal_(1.0, 0.2)
            elif "norm" in name:
                t.normal_(0.0, 0.3)
    model = model.float().eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return model


class Harness:
    """Our model of a checkpoint with a KV cache and a GDN state pool of ``slots`` slots,
    run step by step as the runner does (both forward contexts)."""

    def __init__(self, path, slots: int = 8):
        src = resolve_model(str(path))
        self.cfg = ModelConfig.from_hf(src.hf_config)
        self.model = build_model(src, self.cfg, torch.device("cpu"), torch.float32, 0)
        self.runner = ModelRunner(self.model, self.cfg, CacheConfig(block_size=16, num_blocks=64),
                                  torch.device("cpu"), torch.float32)
        self.caches = {layer.layer_idx: (torch.randn(slots, *layer.conv_state_shape),
                                         torch.randn(slots, *layer.ssm_state_shape))
                       for layer in self.model.state_layers()}

    def step(self, seqs, tables, slots, has_initial) -> torch.Tensor:
        """seqs: (token ids, start, end) per sequence -> log-probs of each one's last position."""
        ids, pos, md, qsl = self.runner.prepare(seqs, tables)
        smd = StateMetadata.single(self.caches, torch.tensor(slots, dtype=torch.int32), torch.tensor(has_initial),
                                   md.query_start_loc, md.is_pure_decode, (slots, has_initial, qsl))
        with forward_context(ForwardContext(md, self.runner.kv_caches, self.runner.backend)), state_context(smd):
            hidden = self.model(ids, pos)
        return self.model.compute_logits(hidden[torch.tensor(qsl[1:]) - 1]).log_softmax(-1)


def _hf_last_logprobs(hf, seqs: list) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([hf(torch.tensor([s])).logits[0, -1].float().log_softmax(-1) for s in seqs])


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, make_hybrid_checkpoint(request.param, path, seed=ARCHS.index(request.param))


def test_prefill_and_decode_match_transformers(checkpoint):
    """Four prompts (1 to 40 tokens) batched, their state slots scattered over a pool of
    random states, then four greedy decode steps through the decode path (post-conv +
    recurrent rule): every step's log-probs within 1e-3 of transformers' on the whole
    sequence (transformers' own incremental decode differs from its full recompute by up to
    6e-4 on these fp32 MoE models)."""
    arch, path, hf = checkpoint
    h = Harness(path)
    g = torch.Generator().manual_seed(0)
    toks = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (1, 5, 17, 40)]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(4)]
    slots = [5, 0, 7, 2]
    lp = h.step([(t, 0, len(t)) for t in toks], tables, slots, [False] * 4)
    for _ in range(4):
        ref = _hf_last_logprobs(hf, toks)
        torch.testing.assert_close(lp, ref, atol=1e-3, rtol=0)
        for t, nxt in zip(toks, ref.argmax(-1).tolist()):
            t.append(nxt)
        lp = h.step([([t[-1]], len(t) - 1, len(t)) for t in toks], tables, slots, [True] * 4)
    if arch == "qwen3_5_moe":  # the multimodal folder loaded its text model only
        assert h.cfg.architecture == "Qwen3_5MoeForConditionalGeneration"


def test_chunked_prefill_carries_the_state(checkpoint):
    """Prompts computed in two chunks (the second continuing from the slot's state, beside
    a one-token prompt and a fresh prompt) give the log-probs of the whole prompts."""
    _, path, hf = checkpoint
    h = Harness(path)
    g = torch.Generator().manual_seed(1)
    toks = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (23, 40, 1)]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(3)]
    h.step([(toks[0][:7], 0, 7), (toks[1][:33], 0, 33)], tables[:2], [3, 6], [False, False])
    lp = h.step([(toks[0][7:], 7, 23), (toks[1][33:], 33, 40), (toks[2], 0, 1)], tables, [3, 6, 1],
                [True, True, False])
    torch.testing.assert_close(lp, _hf_last_logprobs(hf, toks), atol=1e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offset_rmsnorm_matches_transformers(dtype):
    """OffsetRMSNorm (weight = 1 + the checkpoint's w, kept fp32) against transformers'
    Qwen3NextRMSNorm: equal in fp32 (with and without the residual add); in bf16 within an
    ulp (we round the normalized x before the multiply, as every RMSNorm here)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, generator=g) * 0.3
    x, r = torch.randn(5, 48, generator=g).to(dtype), torch.randn(5, 48, generator=g).to(dtype)
    hf = Qwen3NextRMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(w)
    ours = OffsetRMSNorm(48, 1e-6).to(dtype)
    assert ours.weight.dtype == torch.float32
    ours.load_checkpoint("weight", w.to(dtype), "norm.weight")
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2 ** -6, rtol=2 ** -7)
    torch.testing.assert_close(ours(x), hf(x), **tol)
    y, s = ours(x, r)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, hf(x + r), **tol)


@pytest.mark.parametrize("preset,billions,gdn_layers", [
    ("qwen3-next-80b-a3b", 79.7, 36), ("qwen3.5-397b-a17b", 396.3, 45), ("qwen3.5-4b", 4.2, 24)])
def test_presets_have_the_published_sizes(preset, billions, gdn_layers):
    """The presets build (on the meta device) with the published parameter counts (without
    the MTP layers and the vision tower) and 3 GDN layers in every 4."""
    src = resolve_model(f"preset:{preset}")
    cfg = ModelConfig.from_hf(src.hf_config)
    with torch.device("meta"):
        model = get_model_class(cfg.architecture)(cfg)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.05)
    assert len(model.state_layers()) == gdn_layers
    assert model.rotary_dim(cfg) == 64


# ---- the engine: batching, chunked prefill, preemption, prefix caching, speculation -------

def _llm(path, **kw):
    from blitzllm import LLM
    return LLM(str(path), device="cpu", dtype="float32", kv_cache_blocks=kw.pop("kv_cache_blocks", 64), **kw)


def _prompts(lengths=(1, 5, 17, 40), seed: int = 7) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in lengths]


def assert_no_leaks(llm) -> dict:
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["num_running"] == st["num_waiting"] == 0
    assert st["state_slots_free"] == st["state_slots_total"]
    return st


def check_generate(llm, hf, prompts, n: int = 12, **params) -> list:
    """Greedy tokens equal transformers', their logprobs within 1e-3; nothing left allocated."""
    from blitzllm import SamplingParams
    from tests.conftest import hf_greedy, hf_logprobs
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0, **params))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, n)
        ours = torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.token_ids)])
        torch.testing.assert_close(ours, hf_logprobs(hf, prompt, out.token_ids), atol=1e-3, rtol=0)
    assert_no_leaks(llm)
    return outs


def test_llm_matches_transformers(checkpoint):
    """Prompts of 1 to 40 tokens batched through the engine: transformers' greedy tokens and
    logprobs; every KV block and state slot back in its pool."""
    _, path, hf = checkpoint
    check_generate(_llm(path), hf, _prompts())


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe_text"])
def test_stacked_shared_expert_matches_transformers(arch, tmp_path, monkeypatch):
    """The gated shared expert stacked as expert E of each MoE block (what the runner's decode
    plan does on CUDA; here the torch ops): batches on the experts' direct path route to it as
    entry K weighted by sigmoid(shared_expert_gate), larger ones run it as its own MLP. Transformers' greedy
    tokens and logprobs, one sequence at a time and batched; the checkpoint's parameters keep
    their names, shapes and values, and the roofline's byte count is unchanged."""
    from blitzllm.bench.roofline import weight_bytes_per_step
    from blitzllm.loader.weights import export_hf_state_dict
    from blitzllm.models.qwen3_next import SharedExpertMoE
    hf = make_hybrid_checkpoint(arch, tmp_path, seed=4, shared_expert_intermediate_size=MOE["moe_intermediate_size"])
    llm = _llm(tmp_path)
    model = llm.engine.runner.model
    before = {k: v.clone() for k, v in export_hf_state_dict(model).items()}
    nbytes = weight_bytes_per_step(model, 1)
    blocks = [m for m in model.modules() if isinstance(m, SharedExpertMoE)]
    assert blocks and all(m.stack_shared_expert() for m in blocks)
    assert all(m.stacks[0].shape[0] == m.stacks[2].shape[0] == MOE["num_experts"] + 1 for m in blocks)
    after = export_hf_state_dict(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert weight_bytes_per_step(model, 1) == nbytes
    calls = []
    run = SharedExpertMoE._experts
    monkeypatch.setattr(SharedExpertMoE, "_experts", lambda self, x, route, stacked=False:
                        calls.append((x.shape[0], stacked)) or run(self, x, route, stacked))
    prompts = _prompts((1, 5, 17, 40))
    for prompt in prompts:
        check_generate(llm, hf, [prompt], n=8)
    check_generate(llm, hf, prompts, n=8)
    from blitzllm.kernels.moe.experts import MOE_DIRECT_MAX_ENTRIES
    limit = MOE_DIRECT_MAX_ENTRIES // (MOE["num_experts_per_tok"] + 1)  # batches on the experts' direct path
    assert all(stacked == (t <= limit) for t, stacked in calls)
    assert {stacked for _, stacked in calls} == {True, False}


def test_shared_expert_of_another_width_is_not_stacked(tmp_path):
    """A shared expert wider than a routed one (the hybrid checkpoints' 48 against 32) stays
    its own MLP: ``stack_shared_expert`` changes nothing."""
    from blitzllm.models.qwen3_next import SharedExpertMoE
    make_hybrid_checkpoint("qwen3_next", tmp_path)
    model = _llm(tmp_path).engine.runner.model
    blocks = [m for m in model.modules() if isinstance(m, SharedExpertMoE)]
    assert blocks and not any(m.stack_shared_expert() for m in blocks)
    assert all(m.stacks is None and m.w13.shape[0] == MOE["num_experts"] for m in blocks)


def test_int4_weights_leave_the_one_row_gate(tmp_path):
    """weight_dtype='int4' (CPU) on Qwen3-Next: the linears torch's int4 packing takes (output rows
    a multiple of 16) are packed, the 1-row shared_expert_gate stays bf16 (packing it failed at
    start-up), and the engine generates."""
    from blitzllm import LLM, SamplingParams
    from blitzllm.layers.linear import Linear
    make_hybrid_checkpoint("qwen3_next", tmp_path, shared_expert_intermediate_size=64)   # (K a multiple of 32)
    llm = LLM(str(tmp_path), weight_dtype="int4", kv_cache_blocks=64, max_num_seqs=4)
    lins = {n: m for n, m in llm.engine.runner.model.named_modules() if isinstance(m, Linear)}
    gates = [m for n, m in lins.items() if n.endswith("shared_expert_gate")]
    assert gates and all(m.qweight is None and m.weight.dtype == torch.bfloat16 for m in gates)
    for n, m in lins.items():   # (the lm_head: int8, packed as well)
        assert (m.qweight is not None) == (n == "lm_head" or m.in_features % 32 == 0 and m.out_features % 16 == 0), n
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    assert_no_leaks(llm)


def test_chunked_prefill_and_preemption(checkpoint):
    """Prompts in chunks of 8 tokens (the state carried from chunk to chunk, decodes beside
    them), then a KV cache and a state pool too small for the load (requests preempted and
    recomputed, others waiting for a slot): the same outputs as transformers."""
    _, path, hf = checkpoint
    prompts = _prompts((17, 40, 33, 25, 3))
    check_generate(_llm(path, max_num_batched_tokens=8), hf, prompts, n=16)
    llm = _llm(path, kv_cache_blocks=8, max_num_seqs=3)
    check_generate(llm, hf, prompts, n=16)
    assert llm.stats()["preemptions"] > 0


def test_prefix_caching_repeated_prompt_and_two_turn_chat(checkpoint):
    """A repeated batch hits the prefix cache (KV blocks and the GDN states at their last block
    boundaries) and gives the same tokens; a second turn whose prompt is the first turn's prompt
    and answer plus new tokens reuses all of its 48 whole-block tokens (the snapshot a decode
    step took at position 48) and matches transformers."""
    _, path, hf = checkpoint
    llm = _llm(path)
    prompts = _prompts((17, 40, 33))
    first = check_generate(llm, hf, prompts)
    before = llm.stats()
    again = check_generate(llm, hf, prompts)
    st = llm.stats()
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    hits = st["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    assert hits == 16 + 32 + 32 == st["state_snapshot_hit_tokens"] - before["state_snapshot_hit_tokens"]
    turn1 = _prompts((37,), seed=11)[0]
    out1 = check_generate(llm, hf, [turn1])[0].token_ids
    before = llm.stats()
    check_generate(llm, hf, [turn1 + out1 + _prompts((9,), seed=12)[0]])
    st = llm.stats()
    assert st["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == 48
    assert st["state_snapshot_hit_tokens"] - before["state_snapshot_hit_tokens"] == 48


class _OracleDrafts:
    """A proposer that knows each prompt's greedy continuation and drafts it with one token
    wrong, at a position that moves from call to call: every acceptance length from 0 to k."""

    def __init__(self, answers: dict):
        self.answers, self.calls = answers, 0

    def propose(self, reqs, limits):
        from blitzllm.spec.base import Proposal
        drafts = []
        for r, lim in zip(reqs, limits):
            truth = self.answers[tuple(r.prompt_token_ids)][len(r.output_token_ids):][:lim]
            bad = self.calls % (lim + 1)
            self.calls += 1
            drafts.append([(t + 1) % 320 if j == bad else t for j, t in enumerate(truth)])
        return Proposal(drafts)

    def finish(self, rid):
        pass

    def stats(self):
        return {}


def test_speculation_rolls_the_state_back(checkpoint):
    """Speculative decoding: n-gram drafts on repetitive prompts, then drafts of every
    acceptance length (a proposer that knows the answer and gets one token wrong): each
    rejection rolls the GDN states back to the last accepted token, and the tokens stay
    transformers' greedy ones."""
    from tests.conftest import hf_greedy
    _, path, hf = checkpoint
    base = _prompts((6, 9, 4), seed=3)
    prompts = [p * 5 for p in base] + [_prompts((13,), seed=4)[0]]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = _llm(path, speculative_config=spec)
    check_generate(llm, hf, prompts, n=24)
    assert llm.stats()["spec_draft_tokens"] > 0
    llm = _llm(path, speculative_config=spec)
    llm.engine.spec.proposer = _OracleDrafts({tuple(p): hf_greedy(hf, p, 24) for p in prompts})
    check_generate(llm, hf, prompts, n=24)
    st = llm.stats()
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"]


def test_abort_and_no_prefix_caching_free_everything(tmp_path):
    """A request aborted mid-generation gives its blocks and its state slot back at once;
    without prefix caching no snapshots are kept and the outputs are transformers'."""
    from blitzllm import SamplingParams
    hf = make_hybrid_checkpoint("qwen3_5_text", tmp_path, seed=9)
    llm = _llm(tmp_path)
    eng = llm.engine
    eng.add_request("a", _prompts((30,))[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert llm.stats()["state_slots_free"] == llm.stats()["state_slots_total"] - 1
    assert eng.abort_request("a")
    assert_no_leaks(llm)
    llm = _llm(tmp_path, enable_prefix_caching=False)
    check_generate(llm, hf, _prompts((17, 40)))
    check_generate(llm, hf, _prompts((17, 40)))
    st = llm.stats()
    assert st["state_snapshots_total"] == st["state_snapshots_cached"] == st["prefix_cache_hit_tokens"] == 0


# ---- the decode look-ahead (CUDA graphs) on the CPU ----------------------------------------------

class EagerGraphs:
    """``DecodeGraphs`` with its captured forward run eagerly (no CUDA): the runner's pipelined
    decode, its look-ahead and the state rows it reads and writes take their real paths here;
    its buffers are filled as ``DecodeGraphs.run`` fills them, padding rows included."""

    def __new__(cls, runner, max_num_seqs: int, width: int):
        from blitzllm.runner.cuda_graphs import DecodeGraphs

        class _Eager(DecodeGraphs):
            def capture(self):
                self.graphs = {b: None for b in self.buckets}

            def run(self, ids, pos, slots, lens, block_tables, state_rows=None, state_dst=None, lora_slots=None):
                n = len(pos)
                b = next(x for x in self.buckets if x >= n)
                pad = b - n
                ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
                self.input_ids[:b] = torch.tensor(ids + [0] * pad)
                self.positions[:b] = torch.tensor(list(pos) + [0] * pad)
                self.slot_mapping[:b] = torch.tensor(list(slots) + [-1] * pad)
                self.seq_lens[:b] = torch.tensor(list(lens) + [1] * pad, dtype=torch.int32)
                self.block_tables.zero_()
                for i, t in enumerate(block_tables):
                    self.block_tables[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
                dst = state_rows if state_dst is None else state_dst
                scratch = [self.states.scratch] * pad
                self.state_rows[:, :b] = torch.tensor([list(state_rows) + scratch, list(dst) + scratch])
                return self._forward(b)[:n]

        g = _Eager(runner.model, runner.kv_caches, runner.backend, runner.device, max_num_seqs, width, runner.states)
        g.capture()
        return g


@pytest.mark.parametrize("spare", [4, 2])
def test_decode_look_ahead_keeps_the_states(checkpoint, monkeypatch, spare):
    """The pipelined decode of the CUDA-graph path on a hybrid model (graphs replaced by an
    eager stand-in): each step's successor runs ahead into spare state rows and is kept (its
    rows become the sequences') or dropped (the states it read untouched). Five requests of 4 to
    30 new tokens on 4 slots, so the batch shrinks and look-aheads are dropped, and the last
    starts (an eager prefill beside decodes) in a slot whose state row has moved; decode steps that complete a
    block take prefix-cache snapshots, which a second round of the same prompts restores; with
    2 spare rows a batch of 4 runs without look-ahead until 2 are left. Tokens and logprobs are
    transformers'; every spare row is free once the engine is idle."""
    from blitzllm import SamplingParams
    from blitzllm.engine import args as engine_args
    from tests.conftest import hf_greedy, hf_logprobs
    _, path, hf = checkpoint
    monkeypatch.setattr(engine_args, "lookahead_rows", lambda args: min(spare, args.max_num_seqs))
    llm = _llm(path, max_num_seqs=4)
    eng, runner = llm.engine, llm.engine.runner
    runner.graphs = EagerGraphs(runner, 4, -(-eng.max_model_len // eng.cache_config.block_size))
    eng.scheduler.lookahead = True
    pool = runner.states
    assert len(pool.spare) == spare
    kept = []
    take = pool.take
    monkeypatch.setattr(pool, "take", lambda slots, rows: (kept.append(len(slots)), take(slots, rows)))
    prompts = _prompts((17, 40, 33, 6, 9))   # the fifth waits for a slot that look-aheads moved
    lengths = [30, 4, 21, 12, 10]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0) for n in lengths]
    for round_ in range(2):
        before = llm.stats()
        outs = llm.generate(prompts, params)
        for prompt, n, out in zip(prompts, lengths, outs):
            assert out.token_ids == hf_greedy(hf, prompt, n)
            ours = torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.token_ids)])
            torch.testing.assert_close(ours, hf_logprobs(hf, prompt, out.token_ids), atol=1e-3, rtol=0)
        st = assert_no_leaks(llm)
        runner._drop_ahead()   # the last step's look-ahead, launched for a step that never came
        rows = pool.spare + [pool.phys[s] for s in range(4)]
        assert len(pool.spare) == spare and len(set(rows)) == len(rows)   # no row both spare and a slot's
    # decode steps took snapshots (40 + 4 crosses no block end; 17 + 30 crosses 32) which round 2 used
    assert st["state_snapshot_hit_tokens"] - before["state_snapshot_hit_tokens"] > 0
    assert kept and (max(kept) == 4 if spare == 4 else max(kept) <= 2)
    assert any(pool.phys[s] != s for s in range(4))   # kept look-aheads moved states to spare rows
