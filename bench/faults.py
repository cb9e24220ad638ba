"""Fault scenarios on real processes: kill -9 a stage under streaming load, mass disconnects,
idle-then-active connections. Each reports how requests ended: ok, error (an error response or
in-band error event), cut (connection lost), hung (still open at the deadline; must be 0).

The test suite runs them small (tests/e2e/test_faults.py); this script runs them large:

    python -m bench.faults [--streams 64] [--clients 200] [--connections 1000]

Loopback only; every load is bounded in count and time.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import threading
import time

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


def fleet(*extra: str) -> Server:
    return Server("--render-workers", "2", "--postproc-workers", "2", "--ingress-workers", "2", "--max-num-seqs",
                  "512", *extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--connections", type=int, default=1000)
    args = parser.parse_args()
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
    print(f"{'scenario':48} {'ok':>5} {'error':>6} {'cut':>5} {'hung':>5}")
    for name, c in rows.items():
        print(f"{name:48} {c['ok']:>5} {c['error']:>6} {c['cut']:>5} {c['hung']:>5}"
              + (f"  exit code {c['exit_code']}" if "exit_code" in c else ""))


if __name__ == "__main__":
    main()
