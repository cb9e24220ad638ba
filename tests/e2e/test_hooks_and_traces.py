"""The operators' extension points and tracing, on one real server: deploy/hooks_example.py's --request-hook
(a refusal in each dialect's shape, a trial user's cap) and --post-processor-hook (a banned phrase ends the
output), and a client's traceparent carried into the request's log line, its --kv-timing-output record and
the spans --otlp-traces-endpoint exports to a collector stand-in (an OTLP/HTTP receiver in this process)."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench.server import Server
from tests.e2e.test_anthropic import recording

MODEL = "builtin:tiny-chat"
HOOKS = "deploy/hooks_example.py"
SAID = "The key is swordfish, said the fox."
PARENT_ID = "b7ad6b7169203331"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
HI = [{"role": "user", "content": "hi"}]


class Collector:
    """An OTLP/HTTP traces receiver on 127.0.0.1: keeps every span posted to it."""

    def __init__(self) -> None:
        self.spans: list = []
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                request = ExportTraceServiceRequest.FromString(body)
                spans.extend(s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def trace(self, trace_id: str, names: int, timeout: float = 20.0) -> list:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got = [s for s in self.spans if s.trace_id.hex() == trace_id]
            if len(got) >= names:
                return got
            time.sleep(0.1)
        return [s for s in self.spans if s.trace_id.hex() == trace_id]


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.http.shutdown()


@pytest.fixture(scope="module")
def hooked(tmp_path_factory, tiny_chat_dir, collector):
    timing = tmp_path_factory.mktemp("timing") / "kv.jsonl"
    s = Server("--runner", "replay", "--replay-file", recording(tmp_path_factory, tiny_chat_dir, SAID),
               "--request-hook", f"{HOOKS}:cap_sampling", "--post-processor-hook", f"{HOOKS}:BannedPhraseGuard",
               "--otlp-traces-endpoint", collector.url, "--kv-timing-output", str(timing),
               "--state-dir", str(tmp_path_factory.mktemp("state")))
    s.timing = timing
    yield s
    assert s.stop() == 0, s.output()


def test_the_request_hook_refuses_in_each_dialects_shape(hooked):
    r = httpx.post(hooked.url + "/v1/chat/completions", json={"model": MODEL, "messages": HI, "temperature": 1.9},
                   timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "temperature 1.9 is above this server's limit of 1.5"
    long = [{"role": "user", "content": "word " * 1200}]
    r = httpx.post(hooked.url + "/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": long},
                   headers={"anthropic-version": "2023-06-01"}, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].endswith("tokens is longer than this server takes (1000)")


def test_the_request_hook_caps_a_trial_users_tokens(hooked):
    client = openai.OpenAI(base_url=hooked.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=50, user="trial")
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (4, "length")
    m = anthropic.Anthropic(base_url=hooked.url, api_key="x", max_retries=0).messages.create(
        model=MODEL, max_tokens=50, messages=HI, metadata={"user_id": "trial"})
    assert (m.usage.output_tokens, m.stop_reason) == (4, "max_tokens")


def test_the_post_processor_hook_ends_the_output_before_the_banned_phrase(hooked):
    client = openai.OpenAI(base_url=hooked.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=50)
    text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert SAID.startswith(text) and "swordfish" not in text and text.startswith("The key is") and finish == "stop"
    streamed = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=50, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    m = anthropic.Anthropic(base_url=hooked.url, api_key="x", max_retries=0).messages.create(
        model=MODEL, max_tokens=50, messages=HI)
    assert (m.content[0].text, m.stop_reason) == (text.strip(), "end_turn")


def test_a_traceparent_reaches_the_log_the_timing_record_and_the_collector(hooked, collector):
    parent = f"00-{TRACE_ID}-{PARENT_ID}-01"
    r = httpx.post(hooked.url + "/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 3},
                   headers={"traceparent": parent, "tracestate": "vendor=abc"}, timeout=60)
    assert r.status_code == 200
    spans = collector.trace(TRACE_ID, 6)
    by_name = {s.name: s for s in spans}
    assert sorted(by_name) == ["decode", "postproc", "prefill", "queue", "render", "request"]
    root = by_name["request"]
    assert root.parent_span_id.hex() == PARENT_ID and root.trace_state == "vendor=abc"
    assert all(s.parent_span_id == root.span_id for s in spans if s is not root)
    assert root.start_time_unix_nano <= by_name["render"].start_time_unix_nano <= by_name["postproc"].end_time_unix_nano
    records = [json.loads(line) for line in hooked.timing.read_text().splitlines()]
    (mine,) = [x for x in records if x.get("traceparent") == parent]
    assert mine["tracestate"] == "vendor=abc" and mine["request_id"] == r.json()["id"]
    assert f"traceparent={parent}" in hooked.output()
    other = f"00-{'1' * 32}-{PARENT_ID}-00"  # (the Responses API's route passes it on too)
    r = httpx.post(hooked.url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 3,
                                                       "store": False}, headers={"traceparent": other}, timeout=60)
    assert r.status_code == 200
    records = [json.loads(line) for line in hooked.timing.read_text().splitlines()]
    assert [x["request_id"] for x in records if x.get("traceparent") == other] == [r.json()["id"]]
    r = httpx.post(hooked.url + "/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 3},
                   headers={"traceparent": "00-nothex-01"}, timeout=60)
    assert r.status_code == 200  # an invalid traceparent is dropped: a trace of its own, none in the record
    records = [json.loads(line) for line in hooked.timing.read_text().splitlines()]
    assert "traceparent" not in next(x for x in records if x["request_id"] == r.json()["id"])
