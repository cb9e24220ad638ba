"""W3C trace context (`traceparent`, `tracestate`) through the stages, and --otlp-traces-endpoint: each
finished request's spans, exported by OpenTelemetry's own SDK (the `tracing` extra) over OTLP/HTTP.

The ingress takes a request's trace context from its headers (an invalid traceparent is dropped, as the W3C
recommendation says: the request starts a trace of its own); it rides with the request to the postproc
worker, which writes it in the request's log line and --kv-timing-output record, and exports the spans: one
for the request (the caller's span its parent), and in it one for each stage of its life (SPANS)."""
from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import urlsplit

from sluice.ipc.messages import TraceContext

log = logging.getLogger("sluice.tracing")
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
MAX_TRACESTATE = 512  # bytes kept of a tracestate (W3C: at least 512 must be propagated)
# A request's stages, each a span from one of its times to the next (PerfMetrics' fields, then its end).
SPANS = (("render", "arrival_time", "render_done_time"), ("queue", "render_done_time", "first_scheduled_time"),
         ("prefill", "first_scheduled_time", "first_token_time"), ("decode", "first_token_time", "last_token_time"),
         ("postproc", "last_token_time", "done_time"))


def from_headers(headers: list[tuple[bytes, bytes]]) -> TraceContext | None:
    """The request's trace context, where it sends a valid traceparent (version 00, or a later one read as 00)."""
    parent = state = b""
    for name, value in headers:
        if name == b"traceparent":
            parent = value
        elif name == b"tracestate":
            state = value if not state else state + b"," + value  # (several headers make one list)
    text = parent.decode("latin-1").strip()
    m = _TRACEPARENT.fullmatch(text)
    if m is None or m[1] == "ff" or (m[1] == "00" and m[5]) or set(m[2]) == {"0"} or set(m[3]) == {"0"}:
        return None
    return TraceContext(text[:55], state.decode("latin-1").strip()[:MAX_TRACESTATE])


def fields(trace: TraceContext | None) -> dict[str, str]:
    """The trace context as the fields of a request's log line and --kv-timing-output record."""
    if trace is None:
        return {}
    return {"traceparent": trace.traceparent, **({"tracestate": trace.tracestate} if trace.tracestate else {})}


def available() -> bool:
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return False
    return True


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of --otlp-traces-endpoint: as given, or with /v1/traces where it has no path."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint {endpoint!r}: give an http(s) URL, e.g. http://collector:4318")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


class Exporter:
    """A postproc worker's spans, batched and sent by the SDK's own thread (off the shard's loop)."""

    def __init__(self, span_exporter: Any, service_name: str = "sluice") -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(span_exporter, schedule_delay_millis=500))
        self.tracer = self.provider.get_tracer("sluice")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def otlp(cls, endpoint: str) -> "Exporter":
        """Spans posted to an OTLP/HTTP collector (--otlp-traces-endpoint)."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls(OTLPSpanExporter(endpoint=traces_url(endpoint)))

    def export(self, trace: TraceContext | None, times: dict[str, float], attributes: dict[str, Any]) -> None:
        """A finished request's spans: `times` holds SPANS' times (seconds since the epoch; 0: not reached)."""
        from opentelemetry import trace as otel

        carrier = {"traceparent": trace.traceparent, "tracestate": trace.tracestate} if trace else {}
        parent = self.propagator.extract(carrier)
        ns = {k: round(v * 1e9) for k, v in times.items() if v}
        root = self.tracer.start_span("request", context=parent, kind=otel.SpanKind.SERVER,
                                      start_time=ns["arrival_time"], attributes=attributes)
        inside = otel.set_span_in_context(root)
        for name, start, end in SPANS:
            if start in ns and end in ns:
                self.tracer.start_span(name, context=inside, start_time=ns[start]).end(end_time=max(ns[start],
                                                                                                    ns[end]))
        root.end(end_time=ns["done_time"])

    def shutdown(self) -> None:
        self.provider.shutdown()
