"""Prometheus exposition of the engine's shared-memory stats."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _EngineCollector:
    def __init__(self) -> None:
        self.stats: dict[str, float] = {}

    def collect(self):
        s = self.stats
        total = s.get("kv_total_blocks") or 1
        yield GaugeMetricFamily("sluice:num_requests_running", "Requests in the running batch", s.get("num_running", 0))
        yield GaugeMetricFamily("sluice:num_requests_waiting", "Requests waiting to be scheduled",
                                s.get("num_waiting", 0))
        yield GaugeMetricFamily("sluice:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)",
                                s.get("kv_used_blocks", 0) / total)
        yield GaugeMetricFamily("sluice:kv_cache_used_blocks", "KV blocks in use", s.get("kv_used_blocks", 0))
        yield GaugeMetricFamily("sluice:kv_cache_total_blocks", "KV blocks in the cache", s.get("kv_total_blocks", 0))
        yield CounterMetricFamily("sluice:num_preemptions", "Preemptions", s.get("num_preemptions", 0))
        yield CounterMetricFamily("sluice:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  s.get("prefix_queries", 0))
        yield CounterMetricFamily("sluice:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  s.get("prefix_hits", 0))
        yield GaugeMetricFamily("sluice:engine_step_seconds", "Duration of the last engine step",
                                s.get("step_time", 0))
        yield CounterMetricFamily("sluice:generation_tokens", "Generated tokens", s.get("generated_tokens", 0))


_collector = _EngineCollector()
_registry = CollectorRegistry()
_registry.register(_collector)


def render_metrics(stats: dict[str, float]) -> bytes:
    _collector.stats = stats
    return generate_latest(_registry)
