"""``blitz bench latency --compare hf``'s peer timing: per-token decode time from
(T(output_len) - T(1)) / (output_len - 1), and the median over repeats."""
import pytest
import torch

from blitzllm.bench import hf_peer


class _FakeHF:
    """generate() advances a fake clock: 0.5 s of prefill, then per token the next of
    ``per_token`` for full-length runs (1 token: prefill only)."""

    def __init__(self, clock, per_token, full_len):
        self.clock, self.per_token, self.full_len, self.calls = clock, iter(per_token), full_len, []

    def generate(self, prompts, max_new_tokens, min_new_tokens, **kw):
        self.calls.append(max_new_tokens)
        step = next(self.per_token) if max_new_tokens == self.full_len else 0.0
        self.clock[0] += 0.5 + (max_new_tokens - 1) * step


def _patched(monkeypatch, per_token, full_len):
    clock = [0.0]
    monkeypatch.setattr(hf_peer.time, "perf_counter", lambda: clock[0])
    return _FakeHF(clock, per_token, full_len)


def test_median_of_repeats(monkeypatch):
    # warm-up first (its 100 s/token must not count), then three (T(8), T(1)) pairs: 3, 1, 2 s/token
    hf = _patched(monkeypatch, [100.0, 3.0, 1.0, 2.0], 8)
    got = hf_peer.hf_decode_seconds_per_token(hf, torch.zeros(1, 4, dtype=torch.long), 8, compiled=False, repeats=3)
    assert got == pytest.approx(2.0)
    assert hf.calls == [8, 8, 1, 8, 1, 8, 1]


def test_single_estimate_and_bad_repeats(monkeypatch):
    hf = _patched(monkeypatch, [100.0, 3.0], 8)
    got = hf_peer.hf_decode_seconds_per_token(hf, torch.zeros(1, 4, dtype=torch.long), 8, compiled=False)
    assert got == pytest.approx(3.0)
    with pytest.raises(ValueError, match="repeats"):
        hf_peer.hf_decode_seconds_per_token(hf, torch.zeros(1, 4, dtype=torch.long), 8, compiled=False, repeats=0)


def test_real_transformers_model_on_cpu():
    """A tiny random transformers Llama decodes: each generate gives exactly the tokens asked
    for (no early stop: the estimate's T(n) - T(1) spans n - 1 decode steps), and the estimate
    is the median of (T(6) - T(1)) / 5 over the repeats, from the times of the very calls (timed
    here around generate, so the launcher's own overhead of microseconds is all that differs)."""
    import time

    import transformers
    conf = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(conf).eval()
    prompts = torch.randint(0, 64, (2, 5))
    calls = []
    real_generate = hf.generate

    def generate(inputs, **kw):
        t0 = time.perf_counter()
        out = real_generate(inputs, **kw)
        calls.append((kw["max_new_tokens"], out.shape[1] - inputs.shape[1], time.perf_counter() - t0))
        return out

    hf.generate = generate
    got = hf_peer.hf_decode_seconds_per_token(hf, prompts, 6, compiled=False, repeats=3)
    assert [c[0] for c in calls] == [6, 6, 1, 6, 1, 6, 1]  # warm-up, then (T(6), T(1)) three times
    assert all(asked == made for asked, made, _ in calls)
    est = sorted(max(t6 - t1, 1e-9) / 5 for (_, _, t6), (_, _, t1) in zip(calls[1::2], calls[2::2]))
    assert got == pytest.approx(est[1], rel=0.02, abs=2e-5)
    assert got > 0
