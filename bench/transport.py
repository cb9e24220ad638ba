"""ZeroMQ inline vs the shared-memory ring, over message sizes from 64 B to 4 MiB.

A ping-pong between two processes through the real channels (PushChannel /
PullChannel with the msgpack codec): the echo side decodes each message and
answers with a tiny ack. Reports the median round trip per size for each
transport, and the smallest size from which shared memory wins; that is the
default `--shm-threshold`.

    python -m bench.transport [--iters 200] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import zmq

from sluice.ipc.messages import Frame, Frames, IngressInput
from sluice.ipc.transport import PullChannel, PushChannel

SIZES = [64, 256, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]


def _echo(directory: str, threshold: int | None) -> None:
    ctx = zmq.Context()
    inbox: PullChannel[IngressInput] = PullChannel(ctx, f"ipc://{directory}/ping", IngressInput)
    out: PushChannel[Frames] = PushChannel(ctx, f"ipc://{directory}/pong")
    ack = Frames([Frame("ack", b"")])
    while True:
        msg = inbox.get()
        assert isinstance(msg, Frames), msg  # the ping side sends only Frames
        if msg.frames[0].request_id == "quit":
            return
        out.put(ack)


def measure(size: int, shm: bool, iters: int) -> float:
    """Median round-trip microseconds for `size`-byte payloads."""
    directory = tempfile.mkdtemp(prefix="sluice-bench-")
    ctx = zmq.Context()
    pong: PullChannel[IngressInput] = PullChannel(ctx, f"ipc://{directory}/pong", IngressInput)
    proc = mp.get_context("spawn").Process(target=_echo, args=(directory, None))
    proc.start()
    ping: PushChannel[Frames] = PushChannel(ctx, f"ipc://{directory}/ping", shm_dir=directory if shm else None,
                                            shm_threshold=0, ring_bytes=64 << 20)
    msg = Frames([Frame("x", os.urandom(size))])
    times = []
    for i in range(iters + 10):
        t0 = time.perf_counter()
        ping.put(msg)
        pong.get()
        if i >= 10:  # warm-up: connection set-up and first-touch page faults
            times.append(time.perf_counter() - t0)
    ping.put(Frames([Frame("quit", b"")]))
    proc.join()
    ping.close()
    pong.close()
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    rows = []
    print(f"{'size':>9} {'zmq inline us':>14} {'shm ring us':>12} {'shm/inline':>10}")
    for size in SIZES:
        inline, shm = measure(size, False, args.iters), measure(size, True, args.iters)
        rows.append({"bytes": size, "inline_us": round(inline, 1), "shm_us": round(shm, 1)})
        print(f"{size:>9} {inline:>14.1f} {shm:>12.1f} {shm / inline:>10.2f}")
    wins = [r["bytes"] for r in rows if r["shm_us"] < 0.9 * r["inline_us"]]
    first = next((s for s in SIZES if all(w in wins for w in SIZES if w >= s)), None)
    print(f"shared memory wins by >10% from {first} bytes up" if first else "shared memory never wins by >10%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "threshold": first}, f, indent=2)


if __name__ == "__main__":
    main()
