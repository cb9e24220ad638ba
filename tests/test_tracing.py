"""W3C trace context from a request's headers, and the spans a finished request exports
(sluice/base/tracing.py), through OpenTelemetry's own SDK."""
from __future__ import annotations

import pytest

from sluice.base import tracing
from sluice.ipc.messages import TraceContext

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize("headers, want", [
    ([(b"traceparent", PARENT.encode())], TraceContext(PARENT)),
    ([(b"traceparent", PARENT.encode()), (b"tracestate", b"a=1"), (b"tracestate", b"b=2")],
     TraceContext(PARENT, "a=1,b=2")),
    ([(b"traceparent", b"01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-later")],  # a later version
     TraceContext("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")),
    ([(b"traceparent", PARENT.encode() + b"-x")], None),  # version 00 has nothing after the flags
    ([(b"traceparent", b"ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")], None),
    ([(b"traceparent", b"00-00000000000000000000000000000000-b7ad6b7169203331-01")], None),
    ([(b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01")], None),
    ([(b"traceparent", PARENT.upper().encode())], None),  # lowercase hex only
    ([(b"tracestate", b"a=1")], None),  # a tracestate alone is dropped
    ([], None),
])
def test_a_traceparent_is_taken_only_when_valid(headers, want):
    assert tracing.from_headers(headers) == want


def test_a_long_tracestate_is_cut():
    got = tracing.from_headers([(b"traceparent", PARENT.encode()), (b"tracestate", b"k=" + b"v" * 2000)])
    assert got is not None and len(got.tracestate) == tracing.MAX_TRACESTATE


@pytest.mark.parametrize("endpoint, url", [("http://c:4318", "http://c:4318/v1/traces"),
                                           ("http://c:4318/", "http://c:4318/v1/traces"),
                                           ("https://c/custom/path", "https://c/custom/path")])
def test_the_traces_url(endpoint, url):
    assert tracing.traces_url(endpoint) == url


def test_an_endpoint_that_is_no_url_is_refused():
    with pytest.raises(ValueError, match="give an http"):
        tracing.traces_url("c:4318")


def test_a_requests_spans_follow_its_stages_under_the_callers_span():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    exporter = tracing.Exporter(memory)
    times = {"arrival_time": 100.0, "render_done_time": 100.01, "first_scheduled_time": 100.02,
             "first_token_time": 100.1, "last_token_time": 100.5, "done_time": 100.51}
    exporter.export(TraceContext(PARENT, "a=1"), times, {"sluice.request_id": "r1"})
    exporter.export(None, {**times, "first_token_time": 0.0, "last_token_time": 0.0}, {})  # (failed before a token)
    exporter.provider.force_flush()
    spans = memory.get_finished_spans()
    first = [s for s in spans if s.context.trace_id == int(PARENT.split("-")[1], 16)]
    by_name = {s.name: s for s in first}
    assert sorted(by_name) == ["decode", "postproc", "prefill", "queue", "render", "request"]
    root = by_name["request"]
    assert root.parent is not None and root.parent.span_id == int(PARENT.split("-")[2], 16) and root.parent.is_remote
    assert root.attributes["sluice.request_id"] == "r1" and root.context.trace_state.get("a") == "1"
    assert all(s.parent.span_id == root.context.span_id for s in first if s is not root)
    assert (by_name["prefill"].start_time, by_name["prefill"].end_time) == (100_020_000_000, 100_100_000_000)
    assert (root.start_time, root.end_time) == (100_000_000_000, 100_510_000_000)
    other = {s.name for s in spans if s not in first}
    assert other == {"request", "render", "queue"}  # a new trace of its own, with the stages it reached
    exporter.shutdown()
