"""What a client cannot hold without bound (issue 15): connections, slow bodies, /metrics series, a stream
it does not read, the parser's stack, /health_generate slots. bench/faults.py runs the same scenarios large."""
from __future__ import annotations

import socket
import time

import anthropic
import httpx
import openai
import pytest

from bench import faults
from bench.server import Server
from tests.e2e.conftest import MODEL

MAX_PENDING = 8
MAX_CONNECTIONS = 1200  # above granian's old default limit of 1,024 connections
TIMEOUT_S = 2.0  # --header-timeout and --body-timeout


@pytest.fixture(scope="module")
def server():
    s = Server("--max-pending", str(MAX_PENDING), "--max-connections", str(MAX_CONNECTIONS), "--header-timeout",
               str(TIMEOUT_S), "--body-timeout", str(TIMEOUT_S), "--max-stream-buffer", "1MiB")
    yield s
    assert s.stop() == 0, s.output()


def ended(socks: list[socket.socket], within: float, ends: dict[int, str] | None = None) -> dict[str, int]:
    """How each held connection ended (see faults.how_it_ended), polling until none is open or time is up (at
    least once); `ends` keeps what earlier polls saw (a poll reads the answer it finds)."""
    ends = {} if ends is None else ends
    deadline = time.monotonic() + within
    while True:
        for i, s in enumerate(socks):
            if i not in ends and (end := faults.how_it_ended(s)) != "open":
                ends[i] = end
        if len(ends) == len(socks) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    outcomes = [ends.get(i, "open") for i in range(len(socks))]
    return {k: outcomes.count(k) for k in set(outcomes)}


def test_held_connections_leave_room_and_are_let_go(server):
    socks = faults.hold_connections(server, 1100)  # silent, half a header, half a body: a third each
    try:
        ends: dict[int, str] = {}
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        # not queued behind them: answered while the server still held every one (it lets them go only at
        # --header-timeout / --body-timeout), a count where a wall-clock bound would flake on loaded cores
        assert ended(socks, 0, ends) == {"open": 1100}
        # the silent and half-header ones are closed at --header-timeout, the half-body ones answered 408
        assert ended(socks, TIMEOUT_S + 5, ends) == {"closed": 734, "408": 366}
    finally:
        for s in socks:
            s.close()


def test_at_the_connection_limit_a_new_client_waits_for_a_free_connection(server):
    """At --max-connections granian stops accepting. A new client gets neither a 503 nor a refusal: its
    connection waits, unanswered, in the kernel's accept queue (--backlog) until a held one closes (here the
    held ones time out), then it is served. Past the accept queue the kernel drops its SYN; it retries."""
    socks = faults.hold_connections(server, MAX_CONNECTIONS)
    try:
        # (30 s: far past the held ones' timeouts, which are what lets it in)
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        assert ended(socks, 0).get("open", 0) < MAX_CONNECTIONS  # it got in once a held one was let go
    finally:
        for s in socks:
            s.close()


def test_a_body_that_stops_coming_gets_408(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S + 5) as s:
        t0 = time.monotonic()
        s.sendall(faults._HALF_BODY)
        head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 408"), head
        # not before --body-timeout (a load can only make it later; the socket's timeout bounds the wait)
        assert time.monotonic() - t0 > TIMEOUT_S - 0.5


def test_unknown_paths_do_not_grow_the_metrics(server):
    result = faults.random_paths(server, 2000)
    # one series per (route or "other", status); there was one per path
    assert result["requests_total_series"] <= 6, result


def test_a_stream_nobody_reads_is_cut_and_aborted(server):
    # Cut a second or so after the client stops reading: on a fast CPU the engine makes ~16k tokens by then
    result = faults.unread_stream(server, 32, 4000, read_after=True, timeout=120)
    assert result["tokens_generated"] < 32 * 4000 // 2, result  # aborted in the engine, long before its end
    assert result["stream_ended"] == "cut", result  # no [DONE]: the client can tell
    assert result["ingress_rss_mb"]["peak"] - result["ingress_rss_mb"]["before"] < 64, result
    faults.wait_idle(server)


@pytest.mark.parametrize("where", ["tools", "response_format"])
def test_deep_nesting_is_a_400_that_says_so(server, where):
    deep = "[" * 5000 + "]" * 5000
    schema = '{"type": "object", "properties": {"a": {"default": %s}}}' % deep
    part = {"tools": '"tools": [{"type": "function", "function": {"name": "f", "parameters": %s}}]' % schema,
            "response_format": '"response_format": {"type": "json_schema", "json_schema": {"name": "s", '
                               '"schema": %s}}' % schema}[where]
    body = '{"model": "%s", "messages": [{"role": "user", "content": "x"}], %s}' % (MODEL, part)
    r = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=30)
    assert r.status_code == 400, r.text
    assert "nested too deeply" in r.json()["error"]["message"]


def test_health_generate_takes_a_slot(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "stream": True, "max_tokens": 3000,
            "ignore_eos": True}
    streams = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(MAX_PENDING)]
    try:
        for s in streams:
            s.sendall(faults.stream_request(body))
        deadline = time.monotonic() + 30
        while server.metrics()["sluice:num_requests_running"] < MAX_PENDING:
            assert time.monotonic() < deadline, "the streams never all ran"
            time.sleep(0.1)
        r = httpx.get(server.url + "/health_generate", timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"], r.text
    finally:
        for s in streams:
            s.close()
    faults.wait_idle(server)
    assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 200


def test_a_deadline_ends_a_stream_stuck_on_a_client_that_reads_nothing():
    """The buffer bound is far away here: only --request-timeout can end this stream. Its relay waits in a
    send that never returns and never sees the deadline's sentinel: the deadline cuts it instead, and the
    engine drops the request."""
    s = Server("--request-timeout", "3", "--max-stream-buffer", "1GiB")
    try:
        result = faults.unread_stream(s, 16, 2000, read_after=True, timeout=60)
        assert result["engine_busy_s"] < 20 and result["tokens_generated"] < 16 * 2000, result
        assert result["stream_ended"] == "cut", result
        faults.wait_idle(s)
    finally:
        assert s.stop() == 0, s.output()


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_a_client_error_that_echoes_a_huge_value_is_a_short_4xx_in_its_dialect(server, sdk):
    """(Issue 37: every client error a 4xx in the dialect's shape, its message a few hundred characters.)"""
    huge = "m" * 100_000
    if sdk == "openai":
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        calls = [lambda: client.chat.completions.create(model=huge, messages=[{"role": "user", "content": "x"}]),
                 lambda: client.chat.completions.create(model=MODEL, messages=[{"role": huge, "content": "x"}])]
        errors: tuple[type[Exception], ...] = (openai.NotFoundError, openai.BadRequestError)
    else:
        anth = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        calls = [lambda: anth.messages.create(model=huge, max_tokens=1, messages=[{"role": "user", "content": "x"}]),
                 lambda: anth.messages.create(model=MODEL, max_tokens=1,
                                              messages=[{"role": huge, "content": "x"}])]  # type: ignore[misc]
        errors = (anthropic.NotFoundError, anthropic.BadRequestError)
    for call, error in zip(calls, errors):
        with pytest.raises(error) as e:
            call()
        body = e.value.response.json()
        if sdk == "anthropic":
            assert body["type"] == "error" and body["error"]["type"] in ("not_found_error", "invalid_request_error")
        else:
            assert {"message", "type", "param", "code"} <= set(body["error"]), body
        message = body["error"]["message"]
        assert len(message) <= 512 and "more characters" in message, message
    assert message.startswith("Invalid enum value 'mmm")

