"""The ingress's per-request frame queue alone: CPU per event from the put to the send (granian's, when its
client's buffer has room: done when called), with 64 streams each given a frame a round and one event-loop
iteration a round (as a step's frames reach the ingress), on uvloop. A queue with a `writer` sends from the
put; one without wakes its reader, which gets the frame and sends it.

    python -m bench.frame_queue [--tree DIR]      # DIR: another source tree's ingress/pipeline.py, to compare
    (for a tree whose ingress imports differ from this one's: PYTHONPATH=DIR python bench/frame_queue.py --tree DIR)
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import time
from pathlib import Path

import uvloop

from sluice.ipc.messages import Frame


def frame_queue_class(tree: Path):
    spec = importlib.util.spec_from_file_location(f"pipeline_{abs(hash(tree))}", tree / "ingress" / "pipeline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FrameQueue


class _Sent:
    """What granian's send returns when the body went into its channel: an awaitable that is done."""

    def __await__(self):
        return iter(())


def send(message: dict) -> _Sent:
    return _Sent()


async def per_event_us(frame_queue, rounds: int, streams: int) -> float:
    queues = []

    async def reader() -> None:
        q = frame_queue(asyncio.current_task())
        if hasattr(q, "writer"):  # (an older tree's queue has none)
            q.writer = send
        queues.append(q)
        while not (frame := await q.get()).done:
            await send({"type": "http.response.body", "body": frame.data, "more_body": True})

    tasks = [asyncio.create_task(reader()) for _ in range(streams)]
    await asyncio.sleep(0)
    frame = Frame("r", b"x" * 100)
    t0 = time.process_time()
    for _ in range(rounds):
        for q in queues:
            q.put_nowait(frame)
        await asyncio.sleep(0)
    for q in queues:
        q.put_nowait(Frame("r", b"", True))
    await asyncio.gather(*tasks)
    return (time.process_time() - t0) / (rounds * streams) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--rounds", type=int, default=20_000)
    parser.add_argument("--streams", type=int, default=64)
    args = parser.parse_args()
    us = uvloop.run(per_event_us(frame_queue_class(args.tree), args.rounds, args.streams))
    print(f"{args.tree}: {us:.2f} us of CPU an event (put to send), {args.streams} streams")


if __name__ == "__main__":
    main()
