"""The roofline's recurrent-state bytes (hybrid GDN models): each decode step reads and writes
every sequence's conv and fp32 recurrent state of every GDN layer, a rank's share of its heads."""
from blitzllm.bench.roofline import state_bytes_per_step
from blitzllm.config import ModelConfig
from blitzllm.loader.source import resolve_model


def test_state_bytes_per_step_of_qwen3_next():
    cfg = ModelConfig.from_hf(resolve_model("preset:qwen3-next-80b-a3b").hf_config)
    conv = 3 * (2 * 16 * 128 + 32 * 128) * 2      # K - 1 = 3 inputs of the q, k, v channels, bf16
    ssm = 32 * 128 * 128 * 4                      # [Hv, dk, dv] fp32
    assert len(cfg.state_layers) == 36 and len(cfg.kv_layers) == 12
    assert state_bytes_per_step(cfg, 1, 2) == 2 * 36 * (conv + ssm)
    assert state_bytes_per_step(cfg, 4, 2, tp_size=2) == 2 * 4 * 36 * (conv + ssm) // 2  # half the heads a rank
    dense = ModelConfig.from_hf(resolve_model("preset:qwen3-0.6b").hf_config)
    assert state_bytes_per_step(dense, 8, 2) == 0 and len(dense.kv_layers) == dense.num_layers
