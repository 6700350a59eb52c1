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
    """A tiny random transformers Llama decodes; the estimate is a positive time per token."""
    import transformers
    conf = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(conf).eval()
    prompts = torch.randint(0, 64, (2, 5))
    got = hf_peer.hf_decode_seconds_per_token(hf, prompts, 6, compiled=False, repeats=3)
    assert 0.0 < got < 5.0
