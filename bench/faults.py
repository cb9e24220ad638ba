"""Fault scenarios on real processes: kill -9 a stage under streaming load, mass disconnects,
idle-then-active connections. Each reports how requests ended: ok, error (an error response or
in-band error event), cut (connection lost), hung (still open at the deadline; must be 0).
Abuse scenarios: connections that never finish a request, random unknown paths, a stream
nobody reads, a flood of /health_generate. A render worker stuck on a job turns /health and
/ready to 503.

The test suite runs them small (tests/e2e/test_faults.py, tests/e2e/test_limits.py); this
script runs them large:

    python -m bench.faults [--streams 64] [--clients 200] [--connections 1000] [--held 1100]
                           [--paths 25000] [--unread-n 128] [--only truncation|render_stall|state_dir]

Loopback only; every load is bounded in count and time.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

from bench.server import Server

MODEL = "builtin:tiny-chat"
STREAM = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "stream": True, "ignore_eos": True,
          "max_tokens": 400}


def run_streams(url: str, count: int, body: dict = STREAM) -> tuple[list[str], list[threading.Thread],
                                                                    threading.Barrier]:
    """`count` streams on threads; the barrier opens once every one has its response headers."""
    results: list[str] = []
    started = threading.Barrier(count + 1, timeout=120)

    def one() -> None:
        outcome = "cut"
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
                started.wait()
                if r.status_code != 200:
                    outcome = "error"
                else:
                    for line in r.iter_lines():
                        if '"error"' in line:
                            outcome = "error"
                        elif line == "data: [DONE]" and outcome == "cut":
                            outcome = "ok"
        except (httpx.HTTPError, threading.BrokenBarrierError):
            pass
        results.append(outcome)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    return results, threads, started


def finish(threads: list[threading.Thread], results: list[str], timeout: float = 120) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    counts = {k: results.count(k) for k in ("ok", "error", "cut")}
    counts["hung"] = sum(t.is_alive() for t in threads)
    return counts


def wait_idle(server: Server, timeout: float = 30) -> None:
    """Until no request runs and no KV block is held."""
    deadline = time.monotonic() + timeout
    while (m := server.metrics())["sluice:kv_cache_used_blocks"] > 0 or m["sluice:num_requests_running"] > 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"still busy after {timeout}s: {m}")
        time.sleep(0.1)


def ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def ingress_workers(server: Server, timeout: float = 10) -> list[int]:
    """The granian worker processes (the supervisor logs granian's pid just after /health answers)."""
    deadline = time.monotonic() + timeout
    while (m := re.search(r"granian pid (\d+)", server.output())) is None:
        if time.monotonic() > deadline:
            raise AssertionError("the server never logged granian's pid")
        time.sleep(0.05)
    granian = int(m.group(1))
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and ppid(int(p)) == granian]


def wait_restarted(server: Server, role: str, old_pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        pids = [int(p) for p in re.findall(rf"{role}\[0\] ready \(pid (\d+)\)", server.output())]
        if pids and pids[-1] != old_pid:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{role}[0] was not restarted")
        time.sleep(0.2)


def kill_render(server: Server, streams: int) -> dict[str, int]:
    pid = server.stage_pid("render")
    os.kill(pid, signal.SIGSTOP)  # jobs routed to render[0] pile up there ...
    results, threads, started = run_streams(server.url, streams)
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)  # ... and die with it
    started.wait()
    counts = finish(threads, results)
    wait_restarted(server, "render", pid)
    return counts


def kill_postproc(server: Server, streams: int) -> dict[str, int]:
    pid = server.stage_pid("postproc")
    results, threads, started = run_streams(server.url, streams)
    started.wait()
    os.kill(pid, signal.SIGKILL)
    counts = finish(threads, results)
    wait_restarted(server, "postproc", pid)
    return counts


def kill_ingress_worker(server: Server, streams: int) -> dict[str, int]:
    workers = ingress_workers(server)
    results, threads, started = run_streams(server.url, streams)
    started.wait()
    os.kill(workers[0], signal.SIGKILL)
    counts = finish(threads, results)
    deadline = time.monotonic() + 30
    while len(ingress_workers(server)) < len(workers):  # granian respawns it
        if time.monotonic() > deadline:
            raise AssertionError("the ingress worker was not respawned")
        time.sleep(0.2)
    return counts


def kill_engine(streams: int) -> dict[str, int]:
    server = Server()
    try:
        results, threads, started = run_streams(server.url, streams, dict(STREAM, max_tokens=4000))
        started.wait()
        os.kill(server.stage_pid("engine"), signal.SIGKILL)
        counts = finish(threads, results)
        counts["exit_code"] = server.proc.wait(30)
        return counts
    finally:
        server.stop(signal.SIGKILL)


def disconnects(server: Server, clients: int) -> dict[str, float]:
    """Clients that leave after their first event: their KV is freed and their generation stops."""
    async def run() -> None:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=clients)) as c:
            async def one() -> None:
                async with c.stream("POST", server.url + "/v1/chat/completions",
                                    json=dict(STREAM, max_tokens=2000)) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            return
            await asyncio.wait_for(asyncio.gather(*[one() for _ in range(clients)]), 240)

    before = server.metrics()["sluice:generation_tokens_total"]
    t0 = time.monotonic()
    asyncio.run(run())
    wait_idle(server)
    settled = server.metrics()["sluice:generation_tokens_total"]
    time.sleep(0.5)
    return {"clients": clients, "tokens_generated": settled - before, "idle_after_s": time.monotonic() - t0,
            "tokens_after_idle": server.metrics()["sluice:generation_tokens_total"] - settled}


def idle_then_active(server: Server, connections: int) -> dict[int, int]:
    """Open every connection, wait, then start a stream on all at once: each is served or refused (503)."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    port = int(server.url.rsplit(":", 1)[1])

    async def run() -> list[int]:
        conns = await asyncio.gather(*[asyncio.open_connection("127.0.0.1", port) for _ in range(connections)])
        await asyncio.sleep(1.0)

        async def active(reader, writer) -> int:
            writer.write(request)
            await writer.drain()
            status = int((await reader.readline()).split()[1])
            writer.close()
            return status

        return await asyncio.wait_for(asyncio.gather(*[active(r, w) for r, w in conns]), 240)

    statuses = asyncio.run(run())
    return {s: statuses.count(s) for s in sorted(set(statuses))}


def stage_pids(server: Server, role: str) -> dict[int, int]:
    """index -> pid of each worker of `role`, restarted ones by their newest pid."""
    return {int(i): int(pid) for i, pid in re.findall(rf"{role}\[(\d+)\] ready \(pid (\d+)\)", server.output())}


def kill_renders_while_decoding(server: Server, requests: int, max_tokens: int) -> dict[str, int]:
    """kill -9 every render worker while non-streaming requests they rendered are decoding: those requests
    are in the engine's hands, so each must still finish with 200 (needs a slow engine: --replay-step-ms)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens,
            "ignore_eos": True}
    results: list[str] = []

    def one() -> None:
        try:
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
            results.append("ok" if r.status_code == 200 else "error")
        except httpx.HTTPError:
            results.append("cut")

    threads = [threading.Thread(target=one, daemon=True) for _ in range(requests)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while server.metrics()["sluice:num_requests_running"] < requests:
        if time.monotonic() > deadline:
            raise AssertionError(f"the {requests} requests never all ran at once")
        time.sleep(0.05)
    pids = stage_pids(server, "render")
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)
    counts = finish(threads, results)
    for pid in pids.values():
        wait_restarted(server, "render", pid)
    return counts


def rss_mb(pids: list[int]) -> float:
    """The resident memory of these processes together."""
    kib = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                kib += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return round(kib / 1024, 1)


_HALF_HEADER = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
_HALF_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"model\": ")


def hold_connections(server: Server, count: int) -> list[socket.socket]:
    """`count` connections that never finish a request: a third silent, a third half a header, a third
    half a body."""
    socks = []
    for i in range(count):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall((b"", _HALF_HEADER, _HALF_BODY)[i % 3])
        socks.append(s)
    return socks


def how_it_ended(s: socket.socket) -> str:
    """A held connection now: 'open', 'closed' by the server with no answer, or the status it answered."""
    s.setblocking(False)
    try:
        data = s.recv(1024)
    except BlockingIOError:
        return "open"
    except OSError:
        return "closed"
    return data.split(b" ", 2)[1].decode() if data else "closed"


def connection_flood(server: Server, count: int, settle: float) -> dict:
    """Hold `count` connections that never finish a request; time /health from a new client while they
    are held, then see how each held one ended `settle` seconds after they were opened."""
    t0 = time.monotonic()
    socks = hold_connections(server, count)
    try:
        t1 = time.monotonic()
        try:
            health: int | str = httpx.get(server.url + "/health", timeout=30).status_code
        except httpx.TimeoutException:
            health = "timeout"
        health_s = time.monotonic() - t1
        time.sleep(max(0.0, settle - (time.monotonic() - t0)))
        ends = [how_it_ended(s) for s in socks]
        return {"held": count, "health": health, "health_s": round(health_s, 2),
                f"after_{settle:g}s": {e: ends.count(e) for e in sorted(set(ends))}}
    finally:
        for s in socks:
            s.close()


def random_paths(server: Server, count: int, headers: dict | None = None) -> dict:
    """`count` requests to distinct unknown /v1/ paths (401 without a key, 404 with one): the
    requests_total series /metrics then holds, its size, and the ingress workers' memory."""
    workers = ingress_workers(server)
    before = rss_mb(workers)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60, headers=headers) as c:
            for start in range(0, count, 64):
                await asyncio.gather(*[c.get(f"/v1/{uuid.uuid4().hex}") for _ in range(min(64, count - start))])

    asyncio.run(run())
    text = httpx.get(server.url + "/metrics", timeout=60, headers=headers).text
    series = sum(line.startswith("sluice:requests_total{") for line in text.splitlines())
    return {"paths": count, "requests_total_series": series, "metrics_kib": len(text) >> 10,
            "ingress_rss_mb": {"before": before, "after": rss_mb(workers)}}


def stream_request(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


def read_to_end(s: socket.socket, timeout: float) -> str:
    """Reads what the server sent: '[DONE]' if the stream ended properly, 'cut' if the server closed it
    short, 'open' if it is still open after `timeout` seconds."""
    s.setblocking(True)
    s.settimeout(timeout)
    tail = b""
    try:
        while data := s.recv(1 << 16):
            tail = (tail + data)[-64:]
    except socket.timeout:
        return "open"
    except OSError:
        return "cut"
    return "[DONE]" if b"data: [DONE]" in tail else "cut"


def unread_stream(server: Server, n: int, max_tokens: int, read_after: bool = False, timeout: float = 300) -> dict:
    """A chat stream (n choices, top_logprobs 20) whose client never reads: the tokens the engine made for
    it, how long until the engine let it go, and the ingress workers' memory (before, peak, and after the
    client left; with read_after, the client reads what is left first and says how the stream ended)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "stream": True, "n": n,
            "max_tokens": max_tokens, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}
    workers = ingress_workers(server)
    before, tokens_before = rss_mb(workers), server.metrics()["sluice:generation_tokens_total"]
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)  # fixed and small: the client's kernel buffers little
    s.connect(("127.0.0.1", server.port))
    s.sendall(stream_request(body))
    t0, peak, m = time.monotonic(), before, server.metrics()
    while time.monotonic() - t0 < timeout:
        peak = max(peak, rss_mb(workers))
        m = server.metrics()
        started = m["sluice:generation_tokens_total"] > tokens_before
        if started and m["sluice:num_requests_running"] + m["sluice:num_requests_waiting"] == 0:
            break
        time.sleep(0.2)
    result: dict[str, object] = {"n": n, "max_tokens": max_tokens,
              "tokens_generated": int(m["sluice:generation_tokens_total"] - tokens_before),
              "engine_busy_s": round(time.monotonic() - t0, 1)}
    if read_after:
        result["stream_ended"] = read_to_end(s, 30)
    s.close()
    time.sleep(2)
    result["ingress_rss_mb"] = {"before": before, "peak": peak, "client_gone": rss_mb(workers)}
    return result


def health_generate_flood(server: Server, calls: int) -> dict[int, int]:
    """`calls` concurrent /health_generate calls: the statuses they got."""
    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=calls)) as c:
            responses = await asyncio.gather(*[c.get(server.url + "/health_generate") for _ in range(calls)])
            return [r.status_code for r in responses]

    statuses = asyncio.run(run())
    return {s: statuses.count(s) for s in sorted(set(statuses))}


def wait_status(server: Server, path: str, status: int, timeout: float) -> float:
    """Seconds until `path` answers `status` (asked every 0.1 s, for at most `timeout` seconds)."""
    start = time.monotonic()
    while httpx.get(server.url + path, timeout=5).status_code != status:
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{path} did not answer {status} within {timeout}s")
        time.sleep(0.1)
    return time.monotonic() - start


def render_stall(server: Server, requests: int, timeout: float = 60) -> dict:
    """render[0] stopped (SIGSTOP: a render stuck where its deadline cannot cut it, in C code) with `requests`
    streams waiting on the pool: /health and /ready answer 503 once it has been stuck past its stall limit
    (--render-timeout + --grammar-compile-timeout + --stall-timeout), and 200 again once it goes on (SIGCONT),
    its streams then served. The seconds each took, /health's answer while stuck, and how the streams ended."""
    pid = server.stage_pid("render")
    os.kill(pid, signal.SIGSTOP)
    try:
        results, threads, started = run_streams(server.url, requests, dict(STREAM, max_tokens=4))
        unready = wait_status(server, "/ready", 503, timeout)
        health = httpx.get(server.url + "/health", timeout=5)
    finally:
        os.kill(pid, signal.SIGCONT)
    ready = wait_status(server, "/ready", 200, timeout)
    try:
        started.wait()
    except threading.BrokenBarrierError:  # (a stream that failed before its headers: finish() counts it)
        pass
    return {"unready_after_s": round(unready, 2), "health_while_stuck": health.status_code,
            "health_says": health.json()["error"]["message"], "ready_again_after_s": round(ready, 2),
            **finish(threads, results, timeout)}


def long_truncation(server: Server, items: int) -> dict:
    """A Responses request of `items` short turns with truncation 'auto' (its prompt far past the context, so
    most turns go), and a one-token chat request sent while it renders: the seconds each took, and their
    statuses (the render pool must not be held by the first: issue 37)."""
    turns = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i} words"} for i in range(items)]
    body = {"model": MODEL, "input": turns, "truncation": "auto", "max_output_tokens": 4, "store": False}
    got: dict = {}

    def truncated() -> None:
        start = time.monotonic()
        r = httpx.post(server.url + "/v1/responses", json=body, timeout=300)
        got["truncation"] = (r.status_code, round(time.monotonic() - start, 3))

    thread = threading.Thread(target=truncated)
    thread.start()
    time.sleep(0.05)
    start = time.monotonic()
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=300,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    beside = (chat.status_code, round(time.monotonic() - start, 3))
    thread.join()
    return {"items": items, "truncation (status, s)": got["truncation"], "chat beside it (status, s)": beside}


def _finished_background(url: str) -> str:
    rid = httpx.post(url + "/v1/responses", timeout=60, json={"model": MODEL, "input": "Hello",
                                                               "max_output_tokens": 4, "background": True}).json()["id"]
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/v1/responses/{rid}", timeout=10).json()["status"] not in ("completed", "incomplete"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"background response {rid} did not finish")
        time.sleep(0.05)
    return rid


def _openai_state_error(body: dict) -> bool:
    return body["error"]["type"] == "server_error" and body["error"]["code"] == "state_unavailable"


def _anthropic_state_error(body: dict) -> bool:
    return body["type"] == "error" and body["error"]["type"] == "api_error"


def state_pulled_away(server: Server, state_dir: Path) -> dict:
    """Stored objects made (a response, a background one, a batch, a chat completion), then the state database
    under the server's open connections overwritten (no longer one): every route of batches, responses and
    stored chat completions must answer a 500 in its dialect's shape naming --state-dir (never a plain-text
    500, never a 200 that claims a save), while what needs no state goes on. Each route's (method, path,
    status, JSON, in the dialect's shape, names it)."""
    url, user = server.url, [{"role": "user", "content": "Hello"}]
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 4}
    stored = httpx.post(url + "/v1/responses", json=body, timeout=60).json()["id"]
    background = _finished_background(url)
    batch_body = {"requests": [{"custom_id": "b", "params": {"model": MODEL, "max_tokens": 4, "messages": user}}]}
    batch = httpx.post(url + "/v1/messages/batches", json=batch_body, timeout=60).json()["id"]
    chat = {"model": MODEL, "messages": user, "max_tokens": 4, "store": True}
    kept = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()["id"]
    for f in state_dir.iterdir():
        if f.is_file():
            f.write_bytes(b"\xff" * max(f.stat().st_size, 4096))
    openai_shaped, anthropic_shaped = _openai_state_error, _anthropic_state_error
    routes = [
        (openai_shaped, "POST", "/v1/responses", body),
        (openai_shaped, "POST", "/v1/responses", {**body, "stream": True}),
        (openai_shaped, "POST", "/v1/responses", {**body, "background": True}),
        (openai_shaped, "POST", "/v1/responses", {**body, "previous_response_id": stored}),
        (openai_shaped, "GET", f"/v1/responses/{stored}", None),
        (openai_shaped, "GET", f"/v1/responses/{background}?stream=true", None),
        (openai_shaped, "GET", f"/v1/responses/{stored}/input_items", None),
        (openai_shaped, "POST", f"/v1/responses/{background}/cancel", None),
        (openai_shaped, "DELETE", f"/v1/responses/{stored}", None),
        (anthropic_shaped, "POST", "/v1/messages/batches", batch_body),
        (anthropic_shaped, "GET", "/v1/messages/batches", None),
        (anthropic_shaped, "GET", f"/v1/messages/batches/{batch}", None),
        (anthropic_shaped, "POST", f"/v1/messages/batches/{batch}/cancel", None),
        (anthropic_shaped, "GET", f"/v1/messages/batches/{batch}/results", None),
        (anthropic_shaped, "DELETE", f"/v1/messages/batches/{batch}", None),
        (openai_shaped, "POST", "/v1/chat/completions", chat),
        (openai_shaped, "POST", "/v1/chat/completions", {**chat, "stream": True}),
        (openai_shaped, "GET", "/v1/chat/completions", None),
        (openai_shaped, "GET", f"/v1/chat/completions/{kept}", None),
        (openai_shaped, "POST", f"/v1/chat/completions/{kept}", {"metadata": {"app": "x"}}),
        (openai_shaped, "GET", f"/v1/chat/completions/{kept}/messages", None),
        (openai_shaped, "DELETE", f"/v1/chat/completions/{kept}", None)]
    answers = []
    for shaped, method, path, json_body in routes:
        r = httpx.request(method, url + path, json=json_body, timeout=30)
        is_json = r.headers.get("content-type") == "application/json"
        answers.append((method, path, r.status_code, is_json, is_json and shaped(r.json()), "--state-dir" in r.text))
    unstored = [httpx.post(url + "/v1/responses", json={**body, "store": False}, timeout=60).status_code,
                httpx.post(url + "/v1/chat/completions", json={**chat, "store": False}, timeout=60).status_code]
    return {"answers": answers, "store_false": unstored, "health": httpx.get(url + "/health", timeout=10).status_code}


def fleet(*extra: str) -> Server:
    return Server("--render-workers", "2", "--postproc-workers", "2", "--ingress-workers", "2", "--max-num-seqs",
                  "512", *extra)


def abuse(args: argparse.Namespace) -> dict:
    """The abuse scenarios on a fleet with the default limits, then (--max-pending lowered so that a
    flood can reach it) on one with a slow engine."""
    server = fleet()
    try:
        result = {"connection_flood": connection_flood(server, args.held, settle=40),
                  "random_paths": random_paths(server, args.paths),
                  "unread_stream": unread_stream(server, args.unread_n, 2000)}
    finally:
        server.stop()
    server = fleet("--runner", "replay", "--replay-step-ms", "20", "--max-pending", "256")
    try:
        result["health_generate_flood (max-pending 256)"] = health_generate_flood(server, 1000)
    finally:
        server.stop()
    return result


def kill_renders_slow_engine(requests: int) -> dict[str, int]:
    server = fleet("--runner", "replay", "--replay-step-ms", "20")
    try:
        return kill_renders_while_decoding(server, requests, 400)
    finally:
        server.stop()


def render_stall_fleet(requests: int) -> dict:
    server = fleet("--render-timeout", "1", "--grammar-compile-timeout", "1")  # stall limit: 1 + 1 + 2 s
    try:
        return render_stall(server, requests)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--held", type=int, default=1100, help="connections that never finish a request")
    parser.add_argument("--paths", type=int, default=25000, help="requests to distinct unknown /v1/ paths")
    parser.add_argument("--unread-n", type=int, default=128, help="choices of the stream nobody reads")
    parser.add_argument("--only", choices=["truncation", "render_stall", "state_dir"],
                        help="run this scenario alone (truncation: 800, 1,600 and 3,200 items on one render worker)")
    args = parser.parse_args()
    if args.only == "truncation":
        server = Server("--render-workers", "1", "--max-model-len", "2048")
        try:
            for items in (800, 1600, 3200):
                print(json.dumps(long_truncation(server, items)))
        finally:
            server.stop()
        return
    if args.only == "render_stall":
        return print(json.dumps({"render_stall": render_stall_fleet(args.streams)}))
    if args.only == "state_dir":
        with tempfile.TemporaryDirectory() as state:
            server = Server("--state-dir", state)
            try:
                result = state_pulled_away(server, Path(state))
            finally:
                server.stop()
        for row in result.pop("answers"):
            print(json.dumps(row))
        return print(json.dumps(result))
    server = fleet()
    try:
        rows = {
            f"kill -9 render[0], {args.streams} streams": kill_render(server, args.streams),
            f"kill -9 postproc[0], {args.streams} streams": kill_postproc(server, args.streams),
            f"kill -9 an ingress worker, {args.streams} streams": kill_ingress_worker(server, args.streams),
        }
        wait_idle(server)
        print(json.dumps({"disconnects": disconnects(server, args.clients)}))
        print(json.dumps({"idle_then_active": idle_then_active(server, args.connections)}))
    finally:
        server.stop()
    rows[f"kill -9 the engine, {args.streams} streams"] = kill_engine(args.streams)
    rows[f"kill -9 every render worker, {args.streams} decoding"] = kill_renders_slow_engine(args.streams)
    print(json.dumps({"abuse": abuse(args)}))
    print(json.dumps({"render_stall": render_stall_fleet(args.streams)}))
    print(f"{'scenario':48} {'ok':>5} {'error':>6} {'cut':>5} {'hung':>5}")
    for name, c in rows.items():
        print(f"{name:48} {c['ok']:>5} {c['error']:>6} {c['cut']:>5} {c['hung']:>5}"
              + (f"  exit code {c['exit_code']}" if "exit_code" in c else ""))


if __name__ == "__main__":
    main()
