"""Faults and shutdown, each on a server of its own."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

from bench.server import Server
from tests.e2e.conftest import MODEL
from tests.e2e.test_orphans import _assert_all_gone, _kill_all, _start

LONG = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True}}


def _stream(url: str, body: dict, results: list, started: threading.Event) -> None:
    """Reads a stream to its end; records ('ok'|'error'|'cut', completion tokens in its usage chunk)."""
    tokens = None
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                started.set()
                if '"error"' in line:
                    results.append(("error", tokens))
                    return
                if line == "data: [DONE]":
                    results.append(("ok", tokens))
                    return
                if '"usage":{' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        results.append(("cut", tokens))
    except httpx.HTTPError:
        results.append(("cut", tokens))
    finally:
        started.set()


def _start_streams(url: str, body: dict, count: int) -> tuple[list, list]:
    results, threads, events = [], [], []
    for _ in range(count):
        started = threading.Event()
        t = threading.Thread(target=_stream, args=(url, body, results, started), daemon=True)
        t.start()
        threads.append(t)
        events.append(started)
    for e in events:
        assert e.wait(60)
    return results, threads


def test_engine_death_fails_in_flight_requests_and_exits_1_leaving_no_process_behind():
    server, pids = _start("--kv-cache-memory", "64MiB")
    try:
        # tiny-chat: 2 layers x (K, V) x 16 tokens x 2 heads x 16 dims x 4 bytes = 8 KiB per block
        assert server.metrics()["sluice:kv_cache_total_blocks"] == (64 << 20) // (8 << 10)
        results, threads = _start_streams(server.url, dict(LONG, max_tokens=4000), 4)
        os.kill(server.stage_pid("engine"), signal.SIGKILL)
        deadline = time.monotonic() + 5
        health = None
        while time.monotonic() < deadline:
            try:
                health = httpx.get(server.url + "/health", timeout=1).status_code
            except httpx.HTTPError:
                health = "down"
            if health != 200:
                break
            time.sleep(0.05)
        assert health in (503, "down")
        for t in threads:
            t.join(15)
            assert not t.is_alive(), "a request was left hanging"
        assert [r[0] for r in results] == ["error"] * 4, results
        assert server.proc.wait(30) == 1, server.output()
        _assert_all_gone(server, pids)
    finally:
        _kill_all(server, pids)


def test_sigterm_drains_in_flight_requests_then_exits_zero():
    server = Server("--served-model-name", "alias-a", "alias-b")
    try:
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == ["alias-a", "alias-b"]
        wrong = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert wrong.status_code == 404
        results, threads = _start_streams(server.url, dict(LONG, model="alias-b", max_tokens=300), 3)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            late = httpx.post(server.url + "/v1/chat/completions", json=dict(LONG, model="alias-a", stream=False,
                                                                             max_tokens=2), timeout=5)
            assert late.status_code == 503 and late.headers["retry-after"]
        except httpx.ConnectError:
            pass  # already past the drain
        for t in threads:
            t.join(60)
        assert [r[0] for r in results] == ["ok"] * 3, results
        assert [n for _, n in results] == [300] * 3
        assert server.proc.wait(60) == 0, server.output()
    finally:
        server.stop(signal.SIGKILL)
