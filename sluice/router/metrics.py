"""The router's /metrics: its decisions, the cache hits it expects, and the time a hand-off takes."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry()
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

REQUESTS = Counter("sluice_router:requests", "Requests answered, by generation route (other: the rest) and status",
                   ["route", "status"], registry=REGISTRY)
DECISIONS = Counter("sluice_router:decisions", "Routing decisions: kv (cached prefix against load), balance "
                    "(load alone: skewed), round_robin; disaggregated, local_prefill, context_failed",
                    ["kind"], registry=REGISTRY)
PROMPT_TOKENS = Counter("sluice_router:prompt_tokens", "Prompt tokens of routed requests (as the router hashed them)",
                        registry=REGISTRY)
CACHE_HIT_TOKENS = Counter("sluice_router:cache_hit_tokens", "Prompt tokens the chosen worker held in its prefix "
                           "cache (by its published block events)", registry=REGISTRY)
CONTEXT_SECONDS = Histogram("sluice_router:context_seconds", "A context worker's answer: the prompt's KV and first "
                            "token", buckets=_LATENCY, registry=REGISTRY)
TRANSFER_SECONDS = Histogram("sluice_router:kv_transfer_seconds", "A generation worker's first bytes after a "
                             "hand-off: reading the KV blocks, and the first token", buckets=_LATENCY,
                             registry=REGISTRY)
UP = Gauge("sluice_router:worker_up", "Whether a worker is in rotation", ["worker", "kind"], registry=REGISTRY)
IN_FLIGHT = Gauge("sluice_router:worker_in_flight", "Requests relayed to a worker and not done", ["worker"],
                  registry=REGISTRY)


def render(workers) -> bytes:
    for w in workers:
        UP.labels(w.url, w.kind).set(1 if w.up else 0)
        IN_FLIGHT.labels(w.url).set(w.load.in_flight)
    return generate_latest(REGISTRY)
