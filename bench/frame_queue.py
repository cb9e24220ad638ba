"""The ingress's per-request frame queue alone: CPU per event of a put, the reader's wake-up and its get,
with 64 streams each given a frame a round and one event-loop iteration a round (as a step's frames reach
the ingress), on uvloop.

    python -m bench.frame_queue [--tree DIR]      # DIR: another source tree's ingress/pipeline.py, to compare
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import time
from pathlib import Path

import uvloop

from ipc.messages import Frame


def frame_queue_class(tree: Path):
    spec = importlib.util.spec_from_file_location(f"pipeline_{abs(hash(tree))}", tree / "ingress" / "pipeline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FrameQueue


async def per_event_us(frame_queue, rounds: int, streams: int) -> float:
    queues = []

    async def reader() -> None:
        q = frame_queue(asyncio.current_task())
        queues.append(q)
        for _ in range(rounds):
            await q.get()

    tasks = [asyncio.create_task(reader()) for _ in range(streams)]
    await asyncio.sleep(0)
    frame = Frame("r", b"x" * 100)
    t0 = time.process_time()
    for _ in range(rounds):
        for q in queues:
            q.put_nowait(frame)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return (time.process_time() - t0) / (rounds * streams) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--rounds", type=int, default=20_000)
    parser.add_argument("--streams", type=int, default=64)
    args = parser.parse_args()
    us = uvloop.run(per_event_us(frame_queue_class(args.tree), args.rounds, args.streams))
    print(f"{args.tree}: {us:.2f} us of CPU an event (put + wake + get), {args.streams} streams")


if __name__ == "__main__":
    sys.exit(main())
