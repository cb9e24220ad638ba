from __future__ import annotations

import asyncio
import time

from ingress.pipeline import FrameQueue
from ipc.messages import Frame


def test_the_queue_counts_the_frame_bytes_waiting_in_it():
    async def run() -> list[int]:
        q = FrameQueue(asyncio.current_task())
        seen = [q.nbytes]
        q.put_nowait(Frame("r", b"x" * 100, False, 200))
        q.put_nowait(object())  # a sentinel weighs nothing
        q.put_nowait(Frame("r", b"y" * 50, True, 200))
        seen.append(q.nbytes)
        for _ in range(3):
            await q.get()
            seen.append(q.nbytes)
        return seen

    assert asyncio.run(run()) == [0, 150, 50, 50, 0]


def test_a_relay_is_stalled_once_it_waits_in_one_send_for_a_while():
    async def run() -> list[bool]:
        q = FrameQueue(asyncio.current_task())
        seen = [q.stalled()]  # nothing being sent: an idle stream is not a stalled one
        q.sending_since = time.monotonic()
        seen.append(q.stalled())
        q.sending_since -= 5
        seen.append(q.stalled())
        q.sending_since = None  # the send returned
        seen.append(q.stalled())
        return seen

    assert asyncio.run(run()) == [False, False, True, False]
