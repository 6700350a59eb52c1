"""Prometheus metrics of one server (a private CollectorRegistry, never the global one): latency
histograms observed per token on the event loop thread, engine gauges and counters read from
the engine's latest stats when /metrics is scraped.
"""
from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0)


class _EngineCollector:
    """Gauges and counters straight from ``engine.stats()`` (zeros while loading)."""

    def __init__(self, stats: Callable[[], Optional[dict]], model_name: str):
        self._stats, self._model = stats, model_name

    def collect(self):
        s = self._stats() or {}
        lab = [self._model]

        def gauge(name, doc, value, family=GaugeMetricFamily):
            g = family(name, doc, labels=["model_name"])
            g.add_metric(lab, float(value))
            return g

        def counter(name, doc, value):
            return gauge(name, doc, value, CounterMetricFamily)

        yield gauge("blitz_num_requests_running", "Sequences in the running batch.", s.get("num_running", 0))
        yield gauge("blitz_num_requests_waiting", "Sequences waiting to be scheduled.", s.get("num_waiting", 0))
        yield gauge("blitz_kv_cache_usage_perc", "Fraction of KV cache blocks held by requests (0-1).",
                    s.get("kv_cache_usage", 0.0))
        yield gauge("blitz_kv_cache_blocks_total", "KV cache blocks in the pool.", s.get("kv_blocks_total", 0))
        yield gauge("blitz_kv_cache_blocks_free", "KV cache blocks not held by any request.",
                    s.get("kv_blocks_free", 0))
        yield counter("blitz_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
                      s.get("prefix_cache_hit_tokens", 0))
        yield counter("blitz_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.",
                      s.get("prefix_cache_queried_tokens", 0))
        yield counter("blitz_num_preemptions", "Sequences preempted for lack of KV blocks.", s.get("preemptions", 0))
        if "cache_config" in s:   # (vLLM's cache_config_info: the configuration as labels, the value 1)
            cc = s["cache_config"]
            info = GaugeMetricFamily("blitz_cache_config_info", "The KV cache's configuration, as labels.",
                                     labels=["model_name", *cc])
            info.add_metric([self._model, *(str(v).lower() if isinstance(v, bool) else str(v) for v in cc.values())],
                            1.0)
            yield info
        yield counter("blitz_prompt_tokens", "Prompt tokens of accepted requests.", s.get("prompt_tokens", 0))
        yield counter("blitz_generation_tokens", "Generated tokens.", s.get("generation_tokens", 0))
        if "kv_leases_held" in s:  # prefill/decode disaggregation (docs/disaggregation.md)
            yield gauge("blitz_kv_leases_held", "Finished prefills whose KV blocks wait for a consumer.",
                        s["kv_leases_held"])
            yield counter("blitz_kv_leases_expired", "Leases freed unclaimed after kv_lease_s.", s["kv_leases_expired"])
            yield counter("blitz_kv_leases_completed", "Leases a consumer pulled (or a router gave back).",
                          s["kv_leases_completed"])
            yield counter("blitz_kv_pulls_ok", "Requests whose prompt KV this consumer pulled.", s["kv_pulls_ok"])
            yield counter("blitz_kv_pulls_failed", "Pulls that failed (then recomputed, or a 503).",
                          s["kv_pulls_failed"])
            yield counter("blitz_kv_pulled_blocks", "KV blocks pulled from producers.", s["kv_pulled_blocks"])
        if "spec_draft_tokens" in s:
            yield counter("blitz_spec_draft_tokens_total", "Draft tokens proposed by speculative decoding.",
                          s["spec_draft_tokens"])
            yield counter("blitz_spec_accepted_tokens_total", "Draft tokens the target accepted.",
                          s["spec_accepted_tokens"])
            yield gauge("blitz_spec_mean_acceptance_length", "Tokens emitted per verify step of a drafting "
                        "request (accepted drafts + 1).", s["spec_mean_acceptance_length"])
            yield gauge("blitz_spec_synthetic", "1 when acceptance is forced (benchmark mode): outputs are not "
                        "the model's.", 1.0 if s.get("spec_synthetic") else 0.0)


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], Optional[dict]]):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        lab = ["model_name"]
        self._ttft = Histogram("blitz_time_to_first_token_seconds", "Time from arrival to the first token.",
                               lab, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self._itl = Histogram("blitz_inter_token_latency_seconds", "Time between consecutive tokens of a sequence.",
                              lab, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self._e2e = Histogram("blitz_e2e_request_latency_seconds", "Time from arrival to the last token.",
                              lab, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self._success = Counter("blitz_request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._rejected = Counter("blitz_request_rejected", "Requests refused before reaching the engine, by status.",
                                 ["model_name", "status"], registry=r)
        r.register(_EngineCollector(stats, model_name))

    # observer interface of AsyncEngine
    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def finished(self, e2e_seconds: float, reason: str) -> None:
        self._e2e.observe(e2e_seconds)
        self._success.labels(self.model_name, reason).inc()

    def rejected(self, status: int) -> None:
        self._rejected.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
