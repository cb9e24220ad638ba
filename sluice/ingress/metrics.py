"""/metrics: every process's counters and histograms, plus the engine's live gauges."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from sluice.base import envs


class EngineCollector:
    """The engine's shared-memory stats as Prometheus gauges and counters."""

    def __init__(self, read) -> None:
        self.read = read

    def collect(self):
        s = self.read()
        total = s.get("kv_total_blocks") or 1
        queries = s.get("prefix_queries", 0)
        yield GaugeMetricFamily("sluice:num_requests_running", "Requests in the running batch", s.get("num_running", 0))
        yield GaugeMetricFamily("sluice:num_requests_waiting", "Requests waiting to be scheduled",
                                s.get("num_waiting", 0))
        yield GaugeMetricFamily("sluice:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)",
                                s.get("kv_used_blocks", 0) / total)
        yield GaugeMetricFamily("sluice:kv_cache_used_blocks", "KV blocks in use", s.get("kv_used_blocks", 0))
        yield GaugeMetricFamily("sluice:kv_cache_total_blocks", "KV blocks in the cache", s.get("kv_total_blocks", 0))
        yield CounterMetricFamily("sluice:num_preemptions", "Preemptions", s.get("num_preemptions", 0))
        yield CounterMetricFamily("sluice:generation_tokens", "Generated tokens", s.get("generated_tokens", 0))
        yield CounterMetricFamily("sluice:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", queries)
        yield CounterMetricFamily("sluice:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  s.get("prefix_hits", 0))
        yield GaugeMetricFamily("sluice:prefix_cache_hit_rate", "Prefix-cache hits / queries since start",
                                s.get("prefix_hits", 0) / queries if queries else 0.0)
        yield GaugeMetricFamily("sluice:engine_step_seconds", "Duration of the last engine step", s.get("step_time", 0))
        yield CounterMetricFamily("sluice:engine_steps", "Engine steps that ran the model", s.get("num_steps", 0))
        yield CounterMetricFamily("sluice:engine_busy_seconds", "Time the engine spent in steps (busy fraction: "
                                  "its rate)", s.get("step_seconds", 0))


def render_metrics(read_engine_stats) -> bytes:
    registry = CollectorRegistry()
    if envs.prometheus_dir():
        MultiProcessCollector(registry)
    registry.register(EngineCollector(read_engine_stats))
    return generate_latest(registry)
