from __future__ import annotations

import asyncio

from ingress.app import FrameQueue
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
        blocked = asyncio.Event()

        async def client_send(message) -> None:  # a client that reads nothing: the send never returns
            if message.get("stuck"):
                await blocked.wait()

        send = q.watch(client_send)
        seen = [q.stalled()]  # nothing sent yet
        await send({})
        seen.append(q.stalled())  # sends that return: an idle stream is not a stalled one
        task = asyncio.create_task(send({"stuck": True}))
        await asyncio.sleep(0)
        seen.append(q.stalled())
        q.sending_since -= 5
        seen.append(q.stalled())
        blocked.set()
        await task
        seen.append(q.stalled())
        return seen

    assert asyncio.run(run()) == [False, False, False, True, False]
