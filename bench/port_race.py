"""Many servers started side by side, none may lose its port: each `sluice serve --port 0` holds the port it
picked from its first moment (sluice.base.ports) while it and its neighbours pick their own KV ports; the harness
reads the port back from the server's log.

    python -m bench.port_race [--servers 50] [--at-once 2] [--model builtin:tiny-chat]

Each server answers /health and one chat request before it is stopped. Prints each start's outcome and a
summary line; exits 1 if any server failed to start or to answer. Loopback only; bounded in count and time.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time

import httpx

from bench.server import Server


def one(index: int, model: str, failures: list[str], lock: threading.Lock) -> None:
    started = time.monotonic()
    try:
        server = Server("--model", model, "--runner", "replay", "--replay-step-ms", "1", startup_timeout=120)
    except RuntimeError as e:
        with lock:
            failures.append(f"server {index}: {str(e)[-2000:]}")
        return
    try:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        if r.status_code != 200:
            with lock:
                failures.append(f"server {index} on port {server.port}: chat answered {r.status_code}")
        print(f"server {index}: port {server.port}, up in {time.monotonic() - started:.1f} s", flush=True)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=int, default=50)
    ap.add_argument("--at-once", type=int, default=2)
    ap.add_argument("--model", default="builtin:tiny-chat")
    args = ap.parse_args(argv)
    failures: list[str] = []
    lock = threading.Lock()
    started = time.monotonic()
    for first in range(0, args.servers, args.at_once):
        threads = [threading.Thread(target=one, args=(i, args.model, failures, lock))
                   for i in range(first, min(first + args.at_once, args.servers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for failure in failures:
        print(failure, file=sys.stderr)
    print(f"{args.servers} servers, {args.at_once} at a time: {args.servers - len(failures)} started and answered, "
          f"{len(failures)} failed, in {time.monotonic() - started:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
