from __future__ import annotations

import asyncio
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.ingress.pipeline import FrameQueue
from sluice.ipc.messages import Frame


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


class _Client:
    """An ASGI send that records the bodies it took; `hold` of them wait for the test to let them through (a
    client whose buffer is full)."""

    def __init__(self, hold: set[int] = frozenset()) -> None:
        self.bodies: list[bytes] = []
        self.hold = hold
        self.waiting: list[asyncio.Future] = []

    def __call__(self, message: dict):
        self.bodies.append(message["body"])
        fut = asyncio.get_running_loop().create_future()
        if len(self.bodies) - 1 in self.hold:
            self.waiting.append(fut)
        else:
            fut.set_result(None)
        return fut


async def _relay(q: FrameQueue, client: _Client, out: list) -> None:
    """The owner's part, as Ingress._relay does it: set the writer, then send what comes to it."""
    q.writer = client
    while True:
        frame = await q.get()
        out.append(frame)
        if frame.done:
            await client({"type": "http.response.body", "body": frame.data, "more_body": False})
            return
        await client({"type": "http.response.body", "body": frame.data, "more_body": True})


def test_a_frame_for_a_waiting_owner_goes_out_without_waking_it():
    async def run():
        client, woken = _Client(), []
        q = FrameQueue(asyncio.current_task())
        owner = asyncio.create_task(_relay(q, client, woken))
        q.owner = owner
        await asyncio.sleep(0)  # the owner waits
        q.put_nowait(Frame("r", b"a"))
        q.put_nowait(Frame("r", b"b"))
        sent_before_it_ran = list(client.bodies)
        await asyncio.sleep(0)
        q.put_nowait(Frame("r", b"c", True))  # a last frame is the owner's to send
        await owner
        return sent_before_it_ran, client.bodies, [f.data for f in woken], q.nbytes

    assert asyncio.run(run()) == ([b"a", b"b"], [b"a", b"b", b"c"], [b"c"], 0)


def test_a_send_that_must_wait_is_finished_by_the_owner_before_what_came_after():
    async def run():
        client, woken = _Client(hold={0}), []
        q = FrameQueue(asyncio.current_task())
        owner = asyncio.create_task(_relay(q, client, woken))
        await asyncio.sleep(0)
        q.put_nowait(Frame("r", b"a"))  # the client's buffer is full: the owner takes over this send
        q.put_nowait(Frame("r", b"b"))
        await asyncio.sleep(0)
        held = (list(client.bodies), q.sending_since is not None, q.nbytes)
        client.waiting.pop().set_result(None)
        q.put_nowait(Frame("r", b"c", True))
        await owner
        return held, client.bodies, q.sending_since

    assert asyncio.run(run()) == (([b"a"], True, 1), [b"a", b"b", b"c"], None)


def test_a_send_refused_outright_goes_back_to_the_owner_whole():
    async def run():
        calls = []

        async def refuse_once(message: dict) -> None:
            calls.append(message["body"])
            if len(calls) == 1:
                raise OSError("the client left")

        q = FrameQueue(asyncio.current_task())

        async def owner() -> str:
            q.writer = refuse_once
            try:
                while True:
                    frame = await q.get()
                    await refuse_once({"body": frame.data})
            except OSError:
                return "left"

        task = asyncio.create_task(owner())
        await asyncio.sleep(0)
        q.put_nowait(Frame("r", b"a"))  # begun here, raising where it runs: the owner meets the error
        return await task, calls

    assert asyncio.run(run()) == ("left", [b"a"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.binary(min_size=1, max_size=4), st.booleans(), st.integers(0, 2)), min_size=1,
                max_size=30))
def test_every_frame_reaches_the_client_once_and_in_order(script):
    """Whatever mix of sends that go through at once, sends that wait, and owner wake-ups in between: the client
    gets each frame's bytes once, in the order they came."""
    async def run() -> list[bytes]:
        hold = {i for i, (_, waits, _) in enumerate(script) if waits}
        client = _Client(hold=hold)
        q = FrameQueue(asyncio.current_task())
        owner = asyncio.create_task(_relay(q, client, []))
        for data, _, pause in script:
            q.put_nowait(Frame("r", data))
            for _ in range(pause):
                await asyncio.sleep(0)
            while client.waiting:
                client.waiting.pop().set_result(None)
        q.put_nowait(Frame("r", b"", True))
        while not owner.done():
            while client.waiting:
                client.waiting.pop().set_result(None)
            await asyncio.sleep(0)
        return client.bodies

    assert b"".join(asyncio.run(run())) == b"".join(data for data, _, _ in script)


def test_a_cut_streams_queue_lets_go_of_its_frames_at_once():
    """Its owner is cancelled and will send none of them: the bytes go now, not when the last holder of the
    queue (its relay's task, its disconnect watcher) is gone."""
    async def run() -> tuple[bool, int]:
        q = FrameQueue(asyncio.current_task())
        for _ in range(3):
            q.put_nowait(Frame("r", b"x" * 1000))
        q.drop()
        return q.empty(), q.nbytes

    assert asyncio.run(run()) == (True, 0)
