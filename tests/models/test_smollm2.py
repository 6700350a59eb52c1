"""SmolLM2-135M-Instruct (the real default model, Q4_1 GGUF): our greedy output equals
transformers' greedy output on the same GGUF in fp32, for 10 chat prompts x 64 tokens
submitted together in one generate call."""
import pytest
import torch

from blitzllm import SamplingParams
from tests.conftest import hf_greedy

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "Give me a Python function that reverses a string.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "What are the health benefits of green tea?",
    "Describe a sunset using exactly five adjectives.",
]


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    import transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32)
    return m.eval()


def test_greedy_matches_transformers(smollm2_llm, hf_model):
    llm = smollm2_llm
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=0))
    for q, prompt, out in zip(QUESTIONS, prompts, outs):
        ref = hf_greedy(hf_model, prompt, 64)
        assert out.token_ids == ref, f"divergence for {q!r}"
        with torch.no_grad():
            first = hf_model(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
        tok = out.token_ids[0]
        assert abs(out.logprobs[0][tok] - first[tok].item()) < 1e-3
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_chat_answers_sensibly(smollm2_llm):
    out = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=20))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_int4_weights_reencode_the_q4_gguf(smollm2_llm):
    """weight_dtype='int4' re-encodes the GGUF's Q4_1 groups on their own grid: every packed
    layer reproduces the fp32 layer's output up to bf16 rounding, and greedy answers agree
    with the fp32 engine."""
    from blitzllm import LLM
    llm = LLM("smollm2", dtype="float32", device="cpu", weight_dtype="int4")
    q_layer = llm.engine.runner.model.model.layers[3].mlp.gate_up_proj
    f_layer = smollm2_llm.engine.runner.model.model.layers[3].mlp.gate_up_proj
    assert q_layer.weight is None and q_layer.qweight.dtype == torch.uint8
    x = torch.randn(5, f_layer.in_features, generator=torch.Generator().manual_seed(0))
    ref, got = f_layer(x), q_layer(x)
    assert (got - ref).abs().max() <= 1e-2 * ref.abs().max()  # bf16 activations + scales
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS[:3]]
    for a, b in zip(llm.generate(prompts, p), smollm2_llm.generate(prompts, p)):
        assert a.token_ids[:4] == b.token_ids[:4]
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
