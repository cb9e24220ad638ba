"""Prometheus metrics, named after vLLM's where one exists (with our prefix), so dashboards map over.

Every stage process records into prometheus_client's multiprocess files
(PROMETHEUS_MULTIPROC_DIR, set by the supervisor for all of them); any ingress
worker's /metrics aggregates them, plus the engine's live gauges.
"""
from __future__ import annotations

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0, 160.0, 640.0)
_TOKEN_GAP = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
              10.0, 20.0, 40.0, 80.0)

REQUESTS = Counter("sluice:requests", "HTTP /v1 requests answered, by route (other: any path without one) and "
                   "status", ["endpoint", "status"])
REQUEST_SUCCESS = Counter("sluice:request_success", "Finished choices by finish reason", ["finished_reason"])
PROMPT_TOKENS = Counter("sluice:prompt_tokens", "Prompt tokens of finished requests")
GENERATION_TOKENS = Counter("sluice:generation_tokens_finished", "Generated tokens of finished requests")
TTFT = Histogram("sluice:time_to_first_token_seconds", "Arrival to the first token", buckets=_LATENCY)
ITL = Histogram("sluice:inter_token_latency_seconds", "Between a request's successive tokens", buckets=_TOKEN_GAP)
E2E = Histogram("sluice:e2e_request_latency_seconds", "Arrival to the last token", buckets=_LATENCY)
QUEUE = Histogram("sluice:request_queue_time_seconds", "Waiting in the engine before first scheduled",
                  buckets=_LATENCY)
PREFILL = Histogram("sluice:request_prefill_time_seconds", "First scheduled to first token", buckets=_LATENCY)
DECODE = Histogram("sluice:request_decode_time_seconds", "First token to last token", buckets=_LATENCY)
IN_FLIGHT = Gauge("sluice:stage_requests_in_flight", "Requests each stage holds (render: its backlog)", ["stage"],
                  multiprocess_mode="livesum")


def observe_many(histogram: Histogram, values: list[float]) -> None:
    """Observes many values with one update per bucket: in multiprocess mode every single update checks
    the pid and packs into the mmap, which per token costs more than the rest of the postproc's work."""
    if not values:
        return
    bounds = histogram._upper_bounds  # the library's own bucket bounds (ends with +Inf)
    counts = np.bincount(np.searchsorted(bounds, values, side="left"), minlength=len(bounds))
    for i in np.flatnonzero(counts):
        histogram._buckets[i].inc(int(counts[i]))
    histogram._sum.inc(float(sum(values)))


class Deferred:
    """Updates kept in the process and written together by flush(): in multiprocess mode each single update
    checks the pid and packs into an mmap, and the five to eight of a finished request were a sixth of what the
    postproc spent on a one-token request. The stage flushes every so often and whenever it has nothing in
    flight, so an idle server's metrics are complete."""

    def __init__(self) -> None:
        self._observed: dict[Histogram, list[float]] = {}
        self._counted: dict[tuple[Counter, tuple[str, ...]], float] = {}
        self.at = 0.0  # time.monotonic() of the last flush

    def observe(self, histogram: Histogram, value: float) -> None:
        if (values := self._observed.get(histogram)) is None:
            values = self._observed[histogram] = []
        values.append(value)

    def inc(self, counter: Counter, amount: float = 1, *labels: str) -> None:
        key = (counter, labels)
        self._counted[key] = self._counted.get(key, 0) + amount

    def flush(self, now: float) -> None:
        for histogram, values in self._observed.items():
            observe_many(histogram, values)
        for (counter, labels), amount in self._counted.items():
            (counter.labels(*labels) if labels else counter).inc(amount)
        self._observed, self._counted, self.at = {}, {}, now


LATER = Deferred()  # this process's
FLUSH_S = 0.25  # a stage flushes LATER (and its per-step metrics) at least this often while busy


def observe_finished(seq) -> None:
    """Engine side: a finished choice's queue, prefill and decode times (deferred)."""
    if seq.first_scheduled_time:
        LATER.observe(QUEUE, max(0.0, seq.first_scheduled_time - (seq.render_done_time or seq.arrival_time)))
    if seq.first_token_time:
        LATER.observe(PREFILL, seq.first_token_time - seq.first_scheduled_time)
        LATER.observe(DECODE, seq.last_token_time - seq.first_token_time)
