"""``blitz bench latency --compare``: on a CPU, ours and each peer are timed in rounds, back to
back (bench/latency.py ``paired_rounds``), and a speedup is the median of the rounds' ratios."""
import json

from blitzllm.bench.latency import paired_rounds
from blitzllm.cli import main


def test_rounds_pair_ours_with_each_peer_and_alternate_the_order():
    calls = []

    def timer(name, value):
        return lambda: calls.append(name) or value

    runs, peer_runs = paired_rounds(timer("ours", (1.0, 0.1)), {"hf": timer("hf", 2.0), "ll": timer("ll", 3.0)}, 3)
    assert calls == ["ours", "hf", "ll", "ll", "hf", "ours", "ours", "hf", "ll"]
    assert runs == [(1.0, 0.1)] * 3 and peer_runs == {"hf": [2.0] * 3, "ll": [3.0] * 3}


def test_compare_hf_on_cpu_reports_the_paired_ratio(tiny_llama, tmp_path, monkeypatch):
    from blitzllm.bench import latency
    seen = {}
    real = latency.paired_rounds

    def spy(ours, peers, rounds):
        seen["rounds"], seen["peers"] = rounds, sorted(peers)
        seen["out"] = real(ours, peers, rounds)
        return seen["out"]

    monkeypatch.setattr(latency, "paired_rounds", spy)
    out = tmp_path / "r.json"
    assert main(["bench", "latency", "--model", str(tiny_llama[0]), "--device", "cpu", "--input-len", "8",
                 "--output-len", "6", "--compare", "hf", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    runs, peer_runs = seen["out"]
    assert seen["rounds"] == latency.CPU_REPEATS and seen["peers"] == ["hf_eager"]
    hf = peer_runs["hf_eager"]
    ratios = sorted(t / o for t, (o, _) in zip(hf, runs))
    assert res["speedup_vs_hf_eager"] == ratios[1]
    assert res["hf_eager_tokens_per_s"] == 1 / sorted(hf)[1]
    assert res["tokens_per_s"] == 1 / sorted(runs)[1][0]


def test_lora_rank_times_requests_under_a_random_adapter(tiny_llama, tmp_path, monkeypatch, capsys):
    """``--lora-rank R``: the engine is built with enable_lora and every timed request carries
    the same random rank-R adapter on every wrapped projection (its figures say so)."""
    from blitzllm.bench import latency
    from blitzllm.engine.engine import Engine
    seen = []
    real = Engine.add_request

    def spy(self, request_id, prompt, params, **kw):
        seen.append(kw.get("lora_request"))
        return real(self, request_id, prompt, params, **kw)

    monkeypatch.setattr(Engine, "add_request", spy)
    out = tmp_path / "r.json"
    assert main(["bench", "latency", "--model", str(tiny_llama[0]), "--device", "cpu", "--input-len", "8",
                 "--output-len", "4", "--lora-rank", "4", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["lora_rank"] == 4 and res["cuda_graphs"] is False and res["tokens_per_s"] > 0
    assert len(seen) == 1 + latency.CPU_REPEATS and len({id(x) for x in seen}) == 1 and seen[0].lora_name == "bench"
    assert main(["bench", "latency", "--model", str(tiny_llama[0]), "--lora-rank", "4", "--compare", "hf"]) == 2
    assert "--lora-rank times this engine alone" in capsys.readouterr().err
