"""Faults under load on real processes (loopback only, bounded in count and time)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.server import Server
from tests.e2e.conftest import MODEL

STREAM = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "stream": True, "ignore_eos": True,
          "max_tokens": 400}


@pytest.fixture(scope="module")
def fleet():
    s = Server("--render-workers", "2", "--postproc-workers", "2", "--ingress-workers", "2", "--max-num-seqs", "512")
    yield s
    assert s.stop() == 0, s.output()


def run_streams(url: str, count: int, body: dict = STREAM) -> tuple[list, list[threading.Thread], threading.Barrier]:
    """Streams in threads; each records "ok", "error" (an error in the response) or "cut" (connection lost)."""
    results: list[str] = []
    started = threading.Barrier(count + 1, timeout=60)

    def one():
        outcome = "cut"
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                if r.status_code != 200:
                    started.wait()
                    results.append("error")
                    return
                lines = r.iter_lines()
                started.wait()
                for line in lines:
                    if '"error"' in line:
                        outcome = "error"
                    elif line == "data: [DONE]" and outcome == "cut":
                        outcome = "ok"
        except httpx.HTTPError:
            pass
        except threading.BrokenBarrierError:
            pass
        results.append(outcome)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    return results, threads, started


def finish(threads, results, timeout=60) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    hung = sum(t.is_alive() for t in threads)
    counts = {k: results.count(k) for k in ("ok", "error", "cut")}
    counts["hung"] = hung
    return counts


def wait_idle(server, timeout=15):
    deadline = time.monotonic() + timeout
    while (m := server.metrics())["sluice:kv_cache_used_blocks"] > 0 or m["sluice:num_requests_running"] > 0:
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


def healthy_request(server) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text


def test_kill_a_render_worker_under_load(fleet):
    pid = fleet.stage_pid("render")  # render[0]
    os.kill(pid, signal.SIGSTOP)  # jobs routed to it pile up there ...
    results, threads, started = run_streams(fleet.url, 8)
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)  # ... and die with it
    started.wait()
    counts = finish(threads, results)
    assert counts["hung"] == 0 and counts["cut"] == 0, counts
    assert counts["error"] >= 1 and counts["ok"] >= 1, counts  # its requests got errors, the others went on
    _wait_restarted(fleet, "render", pid)
    healthy_request(fleet)
    wait_idle(fleet)


def test_kill_a_postproc_worker_under_load(fleet):
    pid = fleet.stage_pid("postproc")  # postproc[0]
    results, threads, started = run_streams(fleet.url, 8)
    started.wait()
    os.kill(pid, signal.SIGKILL)
    counts = finish(threads, results)
    assert counts["hung"] == 0 and counts["cut"] == 0, counts
    _wait_restarted(fleet, "postproc", pid)
    healthy_request(fleet)
    wait_idle(fleet)


def test_kill_an_ingress_worker_under_load(fleet):
    granian = int(re.search(r"granian pid (\d+)", fleet.output()).group(1))
    workers = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == granian]
    assert len(workers) == 2
    results, threads, started = run_streams(fleet.url, 8)
    started.wait()
    os.kill(workers[0], signal.SIGKILL)
    counts = finish(threads, results)
    assert counts["hung"] == 0 and counts["error"] == 0, counts  # its clients lose the connection, nothing hangs
    wait_idle(fleet)  # the dead worker's requests were dropped, not left running
    deadline = time.monotonic() + 15
    while len([p for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == granian]) < 2:
        assert time.monotonic() < deadline, "granian did not respawn the worker"
        time.sleep(0.2)
    for _ in range(4):
        healthy_request(fleet)


def test_200_clients_that_disconnect_mid_stream(fleet):
    async def run():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as c:
            async def one():
                async with c.stream("POST", fleet.url + "/v1/chat/completions",
                                    json=dict(STREAM, max_tokens=2000)) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            return  # leave after the first event: the connection closes
            await asyncio.wait_for(asyncio.gather(*[one() for _ in range(200)]), 120)

    asyncio.run(run())
    wait_idle(fleet, timeout=30)
    generated = fleet.metrics()["sluice:generation_tokens_total"]
    time.sleep(0.5)
    assert fleet.metrics()["sluice:generation_tokens_total"] == generated  # nothing more for them


def test_1000_idle_then_active_connections(fleet):
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    port = int(fleet.url.rsplit(":", 1)[1])

    async def run():
        conns = await asyncio.gather(*[asyncio.open_connection("127.0.0.1", port) for _ in range(1000)])
        await asyncio.sleep(1.0)  # idle ...

        async def active(reader, writer):  # ... then all at once
            writer.write(request)
            await writer.drain()
            status = int((await reader.readline()).split()[1])
            writer.close()
            return status

        return await asyncio.wait_for(asyncio.gather(*[active(r, w) for r, w in conns]), 120)

    statuses = asyncio.run(run())
    assert set(statuses) <= {200, 503} and statuses.count(200) > 0, sorted(set(statuses))
    wait_idle(fleet)


json_values = st.recursive(st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False)
                           | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
fields = st.sampled_from(["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
                          "logprobs", "top_logprobs", "stream", "logit_bias", "tools", "tool_choice",
                          "response_format", "prompt_token_ids_b64", "echo", "min_p", "top_k", "junk"])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       body=st.dictionaries(fields, json_values, max_size=6), valid_model=st.booleans())
def test_fuzzed_bodies_never_get_a_5xx(fleet, path, body, valid_model):
    if valid_model:
        body["model"] = MODEL
        body.setdefault("max_tokens", 2) if isinstance(body.get("max_tokens"), int) else None
    if body.get("stream") is True:
        body["stream"] = False
    try:
        r = httpx.post(fleet.url + path, content=json.dumps(body), timeout=60)
    except httpx.ReadTimeout:
        pytest.fail(f"no answer for {body}")
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert {"message", "type", "param", "code"} <= set(err)


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _wait_restarted(server, role: str, old_pid: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        pids = [int(p) for p in re.findall(rf"{role}\[0\] ready \(pid (\d+)\)", server.output())]
        if pids and pids[-1] != old_pid:
            return
        assert time.monotonic() < deadline, f"{role}[0] was not restarted"
        time.sleep(0.2)
