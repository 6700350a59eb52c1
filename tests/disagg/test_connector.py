"""The connector in one process (no HTTP): the config's keys and errors, leases, and two tiny
engines, a producer and a consumer, moving a prompt's KV over NIXL; the consumer computes only
the prompt's last token and gives the single engine's greedy answer."""
from __future__ import annotations

import time

import httpx
import pytest

from blitzllm.engine.engine import Engine, EngineArgs
from blitzllm.kv_transfer import CacheLayout, KVLoadError, parse_kv_transfer_config
from blitzllm.kv_transfer.leases import LeaseTable
from blitzllm.sampling_params import SamplingParams


def test_config_keys_and_errors():
    c = parse_kv_transfer_config('{"kv_role": "kv_consumer", "kv_connector_extra_config": {"kv_lease_s": 5}}')
    assert c.is_consumer and not c.is_producer and c.kv_lease_s == 5 and c.kv_load_failure_policy == "recompute"
    assert c.kv_connector == "NixlConnector"
    assert parse_kv_transfer_config({"kv_role": "kv_both"}).is_producer
    for bad, word in [({"kv_role": "prefill"}, "kv_role"), ({"kv_role": "kv_both", "kv_lease_s": 0}, "kv_lease_s"),
                      ({"kv_role": "kv_both", "kv_connector": "Mooncake"}, "kv_connector"),
                      ({"kv_role": "kv_both", "kv_load_failure_policy": "retry"}, "kv_load_failure_policy"),
                      ({"kv_role": "kv_both", "kv_rank": 0}, "unknown keys"), ("{", "JSON")]:
        with pytest.raises(ValueError, match=word):
            parse_kv_transfer_config(bad)


def test_leases_expire_and_claims_are_single():
    t = LeaseTable(lease_s=0.2, claim_s=0.2)
    t.add("a", [1, 2], 20)
    t.add("b", [3], 5)
    assert t.claim("a").block_ids == [1, 2] and t.claim("a") is None   # one claim per lease
    assert t.release("a") and t.sweep() == ["a"]
    time.sleep(0.3)
    assert t.claim("b") is None and t.sweep() == ["b"] and t.expired == 1 and t.completed == 1


def test_layouts_across_tensor_parallel_sizes():
    one = CacheLayout(((0, 0, (16, 2, 8)),), "float32", 16, 1)
    assert CacheLayout(((0, 0, (16, 1, 8)),), "float32", 16, 2).mismatch(one) is None   # 2 heads -> 1 a rank
    assert CacheLayout(((0, 0, (16, 1, 8)),), "float32", 16, 4).mismatch(one) is None   # each head on 2 ranks
    why = one.mismatch(CacheLayout(((0, 0, (16, 1, 8)),), "float32", 16, 2))
    assert "producer has tensor_parallel_size 2" in why and "consumer has 1" in why
    three = CacheLayout(((0, 0, (16, 3, 8)),), "float32", 16, 1)
    why = CacheLayout(((0, 0, (16, 1, 8)),), "float32", 16, 2).mismatch(three)
    assert "tensor_parallel_size 1" in why and "consumer has 2" in why and "3 KV heads" in why
    assert "block_size" in CacheLayout(((0, 0, (32, 2, 8)),), "float32", 32, 1).mismatch(one)


@pytest.fixture(scope="module")
def engines(tiny_model):
    def make(role, **kw):
        return Engine(EngineArgs(model=str(tiny_model), device="cpu", kv_cache_blocks=64, max_model_len=256,
                                 enable_prefix_caching=role == "kv_producer",
                                 kv_transfer_config={"kv_role": role, **kw}))
    p, c = make("kv_producer", kv_lease_s=30), make("kv_consumer", kv_load_failure_policy="fail")
    yield p, c
    p.close()
    c.close()


def _run(engine, rid, prompt, params, **kv):
    """The request's events, and the chunks (start, tokens) its steps computed."""
    schedule, chunks = engine.scheduler.schedule, []

    def spy():
        out = schedule()
        chunks.extend((s.start, s.num_tokens) for s in out)
        return out
    engine.scheduler.schedule = spy
    try:
        engine.add_request(rid, prompt, params, **kv)
        events = []
        while engine.has_unfinished():
            events += engine.step()
            engine.connector.tick(engine.kv)
    finally:
        engine.scheduler.schedule = schedule
    return events, chunks


def test_consumer_decodes_from_the_pulled_kv(engines, monkeypatch):
    producer, consumer = engines
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = "Disaggregation moves a prompt's KV cache from the prefill engine to the decode engine."
    ids = consumer.tokenize(prompt)
    want = [t for e in _run(consumer, "ref", ids, greedy)[0] for t in e.new_token_ids]
    evs, _ = _run(producer, "pre", ids, SamplingParams(temperature=0, max_tokens=1),
                  kv_transfer_params={"do_remote_decode": True})
    params = evs[-1].kv_transfer_params
    assert params["remote_num_tokens"] == len(ids) - 1 and producer.kv.usage > 0

    class Claim:  # the producer's /kv_transfer/claim, without HTTP
        def __init__(self, d):
            self.status_code, self._d, self.text = (200 if d else 404), d, "gone"

        def json(self):
            return self._d
    monkeypatch.setattr(httpx, "post", lambda url, json, timeout: Claim(
        producer.connector.claim(json["lease"], json["agent_metadata"])))
    payload = consumer.connector.load(params, ids)
    assert payload is not None and payload.num_tokens == len(ids) - 1
    for _ in range(200):              # the READ's notification releases the lease
        producer.connector.tick(producer.kv)
        if producer.kv.usage == 0:
            break
        time.sleep(0.01)
    assert producer.kv.usage == 0 and producer.stats()["kv_leases_completed"] == 1
    evs, chunks = _run(consumer, "dec", ids, greedy, kv_transfer_params=params, kv_payload=payload)
    assert [t for e in evs for t in e.new_token_ids] == want
    assert chunks[0] == (len(ids) - 1, 1)             # the first step computed only the last prompt token
    assert consumer.kv.usage == 0
    with pytest.raises(KVLoadError, match="claim"):   # the lease is gone: policy 'fail' raises
        consumer.connector.load(params, ids)
    with pytest.raises(KVLoadError, match="prompt"):  # KV of another prompt never lands
        consumer.connector.load(params, ids[:-1])
