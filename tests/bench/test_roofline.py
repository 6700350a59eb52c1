"""Roofline byte counts: dense parameters once, MoE experts by expected activity, MTP none."""
import torch
from torch import nn

from blitzllm.bench.roofline import expected_active_experts, weight_bytes_per_step


class _Experts(nn.Module):
    def __init__(self, e, k, h, i):
        super().__init__()
        self.num_experts, self.top_k = e, k
        self.w13 = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.zeros(e, h, i))


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(8, 8, bias=False)           # 64 params
        self.moe = _Experts(e=16, k=2, h=8, i=4)            # 16 * (64 + 32) params
        self.mtp = nn.Linear(8, 8, bias=False)              # not run by decoding


def test_expected_active_experts_limits():
    assert expected_active_experts(128, 8, 1) == 8            # one token: exactly its top-k
    assert abs(expected_active_experts(128, 8, 10**6) - 128) < 1e-9
    # two tokens: 8 + 8 minus the expected overlap 8 * 8 / 128
    assert abs(expected_active_experts(128, 8, 2) - (16 - 64 / 128)) < 1e-9


def test_weight_bytes_count_active_experts_only():
    m = _Toy()
    per_expert = (2 * 4 * 8 + 8 * 4) * 4  # fp32 bytes of one expert's w13 + w2
    dense = 64 * 4
    assert weight_bytes_per_step(m, 1) == dense + 2 * per_expert
    want = dense + expected_active_experts(16, 2, 4) * per_expert
    assert abs(weight_bytes_per_step(m, 4) - want) <= 1


def test_kernel_timeline_idle_and_overlap():
    from blitzllm.bench.roofline import kernel_timeline
    # [0,10] and [8,12] overlap by 2 (a PDL-style early start); gap 12..15; [15,20];
    # [16,17] inside it (1 us overlap); gap 20..30; [30,31]
    t = kernel_timeline([(15, 20), (0, 10), (8, 12), (16, 17), (30, 31)])
    assert t["span_us"] == 31
    assert t["idle_us"] == (15 - 12) + (30 - 20)
    assert t["overlap_us"] == 2 + 1
    assert t["copy_us"] == 0
    # a copy in the 20..30 gap (22..25) is not idle time; one before the first kernel counts
    # as copy time but not inside the span
    c = kernel_timeline([(15, 20), (0, 10), (8, 12), (16, 17), (30, 31)], [(22, 25), (-5, -1)])
    assert c["span_us"] == 31 and c["idle_us"] == (15 - 12) + (30 - 20) - 3 and c["copy_us"] == 3 + 4
    assert c["overlap_us"] == 3
    assert kernel_timeline([]) == {"span_us": 0.0, "idle_us": 0.0, "overlap_us": 0.0, "copy_us": 0.0}


def test_kernel_exposed_charges_each_kernel_past_the_previous_end():
    from blitzllm.bench.roofline import kernel_exposed
    # a [0,10]; b starts early (PDL) at 2, waits, ends at 13: charged 3; c [15,20] after a
    # 2 us launch gap: charged 5 (the gap is nobody's); a second b [18,22] inside c's tail: 2
    k = kernel_exposed([("c", 15, 20), ("a", 0, 10), ("b", 2, 13), ("b", 18, 22)])
    assert k == {"a": 10, "b": 3 + 2, "c": 5}
    # the charges add up to the busy time (span less the gaps)
    assert sum(k.values()) == 22 - 2
    assert kernel_exposed([]) == {}
