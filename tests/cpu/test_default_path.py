"""The default CPU path on the default model (SmolLM2-135M Q4_1 GGUF, no dtype asked): the
linears keep the file's 4-bit / 8-bit codes (loader/gguf_grid.py, kernels/cpu_quant) and decode
runs runner/cpu_graph.py. Its greedy output against transformers on the GGUF's dequantized
weights in fp32 (the oracle), on 12 chat prompts unlike the other tests' x 48 tokens: at least
11 equal, and where one differs, the first differing token is a near tie for the oracle (its
logprob within 1e-2 of the oracle's choice): fp32 summation order, not a bug."""
import pytest
import torch

from blitzllm import LLM, SamplingParams
from tests.conftest import hf_greedy, hf_logprobs

PROMPTS = [
    "How do I boil an egg so the yolk stays soft?",
    "Name two differences between a violin and a cello.",
    "What does a compiler do?",
    "Suggest a name for a small bakery by the harbour.",
    "Why do cats purr?",
    "Write one sentence about autumn leaves.",
    "What is 17 times 3?",
    "Give a tip for learning to juggle.",
    "Who wrote Pride and Prejudice?",
    "Explain what a leap year is.",
    "What should I pack for a weekend hike?",
    "Describe the taste of lemon to someone who never had one.",
]
N = 48


@pytest.fixture(scope="module")
def default_llm():
    return LLM("smollm2", device="cpu")


def test_default_keeps_the_gguf_grid(default_llm):
    model = default_llm.engine.runner.model
    layer = model.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert lin.weight is None and lin.quant is not None and lin.quant.kind == "q4"  # Q4_1
        assert lin.quant.parts is None  # (our AVX-512 kernel, not torch's int4 one)
    assert model.lm_head.quant.kind == "q8"  # the tied Q8_0 table
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert default_llm.engine.runner.cpu_decode is not None
    # an asked dtype keeps the dequantized float weights
    assert LLM("smollm2", device="cpu", dtype="float32", num_layers=1).engine.runner.model.lm_head.quant is None


def test_default_greedy_matches_transformers(default_llm, smollm2_hf):
    hf_model = smollm2_hf  # (tests/conftest.py: transformers on the same GGUF, fp32)
    llm = default_llm
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))
    equal, gaps = 0, []
    for q, prompt, out in zip(PROMPTS, prompts, outs):
        ref = hf_greedy(hf_model, prompt, N, guess=out.token_ids)
        if out.token_ids == ref:
            equal += 1
            continue
        j = next(i for i, (a, b) in enumerate(zip(ref, out.token_ids)) if a != b)
        lp = hf_logprobs(hf_model, prompt, ref[:j] + [ref[j]])[-1].item()
        lq = hf_logprobs(hf_model, prompt, ref[:j] + [out.token_ids[j]])[-1].item()
        gaps.append((q, j, lp - lq))
    assert equal >= 11, (equal, gaps)
    assert all(g < 1e-2 for _, _, g in gaps), gaps
