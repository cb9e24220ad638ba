"""The ingress's side of the pipeline, with no HTTP in it: submit a request to the render pool, get its
frames back in a queue of its own, end it on a deadline, a failure or a stage's death. Ingress workers
use it under their routes; a process that does work for nobody's open connection (a batch, a background
response) uses it as they do."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from typing import Awaitable, Callable

import zmq
import zmq.asyncio

from sluice.base import metrics, procs
from sluice.base.config import ServerConfig
from sluice.ipc.addresses import shard_of
from sluice.ipc.messages import (Abort, ControlInput, Drain, DrainTimedOut, EngineDied, EngineInput, EngineRequest,
                                 Failure, Frame, Frames, IngressInput, IngressStatus, RenderInput, RenderJob, StageDied,
                                 SupervisorInput)
from sluice.ipc.stats import EngineStats, StageClocks, stall_limits
from sluice.ipc.transport import PullChannel, PushChannel, SubChannel

_STATUS_INTERVAL_S = 0.2
STALL_S = 1.0  # a relay stuck this long in one send to its client is stalled (a stream past its bound is cut)
_TRIM_AFTER_S = 0.5  # a cut stream's heap is trimmed once its last holders (its relay, its watcher) are gone
_TRIM_BYTES = 1 << 20  # frames a stream whose client left still held that are worth a trim too
DISCONNECTED = object()  # sentinels in a request's queue: its client left,
TIMED_OUT = object()  # or its --request-timeout passed
# The status a request that its client left (or stopped reading: its stream was cut) is counted and logged with,
# as nginx does: the client got less than a whole response, and no 2xx says it did.
CLIENT_CLOSED = 499
log = logging.getLogger("sluice.ingress")


def ended_as(status: int) -> str:
    """The request log line's words for a request that ended without a 2xx or 3xx."""
    return "client left" if status == CLIENT_CLOSED else "request refused"


_ENGINE_DEAD = Failure(500, "the engine process died; the server is restarting", "engine_dead")

class FrameQueue:
    """One request's frames (and sentinels) on their way to its client, with the frame bytes waiting in it.

    `owner` is the task writing them out, its one reader: a deque and the reader's one waiting future, not
    asyncio.Queue's machinery for many readers and joins on every event (bench/frame_queue.py). Once its stream
    began, the owner sets `writer` (the ASGI send): a frame that comes while the owner waits with nothing queued
    is then written by whoever puts it, the pipeline's frame reader, with no wake-up of the owner and no task
    switch per event. Stuck in a send to a client that does not read, the owner sees neither the queue nor
    anything else: cancelling it is the one way to end that response."""

    __slots__ = ("owner", "writer", "nbytes", "sending_since", "cut", "_items", "_waiter")

    def __init__(self, owner: asyncio.Task) -> None:
        self.owner = owner
        self.writer: Callable[[dict], Awaitable] | None = None
        self.nbytes = 0
        self.sending_since: float | None = None  # when the owner's current send began (set around each send)
        self.cut = False  # the stream was cut for its slow client: drop its frames, the owner ends it
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None  # the owner's, while it waits for an item

    def put_nowait(self, item) -> None:
        waiter = self._waiter
        if (type(item) is Frame and self.writer is not None and waiter is not None and not waiter.done()
                and not self._items and not item.done and item.error is None):
            item = self._write(self.writer, item)
            if item is None:
                return
        if type(item) is Frame:
            self.nbytes += len(item.data)
        self._items.append(item)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _write(self, writer: Callable[[dict], Awaitable], frame: Frame) -> Frame | _Sending | None:
        """Sends a frame for the waiting owner: None once sent. A send that must wait (its client's buffer is
        full), or that failed once begun, comes back for the owner to finish before anything else; the frame
        itself when its send was refused outright, for the owner to meet the refusal in its own send."""
        try:  # (granian's send has sent when it returns; a coroutine sends as it runs)
            sending = _Sending(writer({"type": "http.response.body", "body": frame.data, "more_body": True}))
        except Exception:
            return frame
        if sending.done:
            return None
        self.sending_since = time.monotonic()
        return sending

    def empty(self) -> bool:
        return not self._items

    def drop(self) -> None:
        """Lets go of every frame waiting (a cut stream's: nobody will send them), now, not when the owner's
        task and whatever still refers to it are gone."""
        self._items.clear()
        self.nbytes = 0

    def get_nowait(self):
        if not self._items:
            raise asyncio.QueueEmpty
        item = self._items.popleft()
        if type(item) is Frame:
            self.nbytes -= len(item.data)
        return item

    async def get(self):
        while True:
            while not self._items:  # (a cancelled wait leaves the items where they are)
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            item = self.get_nowait()
            if type(item) is not _Sending:
                return item
            try:
                await item
            finally:
                self.sending_since = None

    def stalled(self) -> bool:
        """The owner has been stuck in a send for a while: its client takes nothing. (A full queue alone is
        not enough: the frame reader does not yield while messages are ready, so a burst of them can fill a
        queue before its relay gets to run.)"""
        return self.sending_since is not None and time.monotonic() - self.sending_since > STALL_S


class _Sending:
    """A send begun for a queue's owner, run to where it first waits; awaiting it runs the rest (or raises what
    it raised)."""

    __slots__ = ("done", "_steps", "_blocker", "_error")

    def __init__(self, send: Awaitable) -> None:
        self._steps = send.__await__()
        self._error: BaseException | None = None
        try:
            self._blocker = next(self._steps)
            self.done = False
        except StopIteration:
            self.done = True
        except Exception as e:
            self._error, self.done = e, False

    def __await__(self):
        if self._error is not None:
            raise self._error
        yield self._blocker
        return (yield from self._steps)


class Pipeline:
    def __init__(self, cfg: ServerConfig, share: int = 1) -> None:
        """`share`: how many processes split --max-pending with this one (the ingress workers)."""
        self.cfg = cfg
        self.address = cfg.addresses.ingress(os.getpid())
        self.pending: dict[str, FrameQueue] = {}
        self.max_pending = -(-cfg.max_pending // share)
        self.draining = False
        self.engine_dead = False
        self._deadlines: dict[str, asyncio.TimerHandle] = {}
        self._actx = zmq.asyncio.Context()
        self._ctx = zmq.Context()
        self._inbox: PullChannel[IngressInput] = PullChannel(self._ctx, self.address, IngressInput)
        addr = cfg.addresses
        self._control: SubChannel[ControlInput] = SubChannel(self._actx, addr.control, ControlInput)
        # One channel per render worker, dealt round-robin, so a dead worker's requests are known.
        self._renders: list[PushChannel[RenderInput]] = [PushChannel(self._ctx, addr.render(i))
                                                         for i in range(cfg.render_workers)]
        self._next_render = 0
        self._rendered_by: dict[str, int] = {}  # request -> render worker, until it is in the engine
        self._engine: PushChannel[EngineInput] = PushChannel(self._ctx, addr.engine)
        self._supervisor: PushChannel[SupervisorInput] = PushChannel(self._ctx, addr.supervisor)
        self.stats = EngineStats(addr.stats_path)
        self.clocks = StageClocks(addr.stage_clocks_path, cfg.render_workers, cfg.postproc_workers)
        self._stall_limits = stall_limits(cfg.stall_timeout, cfg.render_timeout, cfg.grammar_compile_timeout)
        self._tasks: list[asyncio.Task] = []
        self._trim_due = False

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(t()) for t in (self._read_control, self._report)]
            asyncio.get_running_loop().add_reader(self._inbox.fd, self._read_frames)
            self._read_frames()  # what came before the reader was added

    @property
    def full(self) -> bool:
        return len(self.pending) >= self.max_pending

    def health_problem(self) -> str | None:
        """Why the server cannot serve now, if it cannot: the engine died, or made no progress (nor idled,
        answering) within the stall timeout; or a render or postproc worker has been on one job (or silent)
        past its stall limit (ipc/stats.py)."""
        s = self.stats.read()
        if self.engine_dead or s["alive"] != 1 or time.time() - s["heartbeat"] >= self.cfg.stall_timeout:
            return "engine unavailable"
        stalls = self.clocks.stalled(self._stall_limits)
        if stalls:
            return f"{stalls[0].role} worker {stalls[0].index} is stuck: on one job (or silent) for " \
                   f"{stalls[0].seconds:.0f}s"
        return None

    # ---- one request -----------------------------------------------------------

    def open(self, rid: str) -> FrameQueue:
        """The queue `rid`'s frames will come to, owned by the calling task (it writes them out)."""
        owner = asyncio.current_task()
        assert owner is not None, "opened from a request's own task"
        q = FrameQueue(owner)
        self.pending[rid] = q
        metrics.IN_FLIGHT.labels("ingress").set(len(self.pending))
        if self.cfg.request_timeout:
            self._deadlines[rid] = asyncio.get_running_loop().call_later(self.cfg.request_timeout, self.end, rid, q,
                                                                         TIMED_OUT)
        if self.engine_dead:  # (one that passed the door as the engine died, after its in-flight ones were failed)
            self.fail([rid], _ENGINE_DEAD)
        return q

    def submit(self, rid: str, job: RenderJob) -> None:
        k = self._next_render = (self._next_render + 1) % len(self._renders)
        self._rendered_by[rid] = k
        self._renders[k].put(job)

    def submit_engine(self, request: EngineRequest) -> None:
        """A request already in token ids (the gRPC door's) goes straight to the engine."""
        self._engine.put(request)

    def abort(self, rid: str) -> None:
        """Nobody will read `rid`'s output: the engine drops it, and its render worker if it is still there."""
        self._engine.put(Abort([rid]))
        if (k := self._rendered_by.get(rid)) is not None:
            self._renders[k].put(Abort([rid]))

    def close(self, rid: str) -> None:
        q = self.pending.pop(rid)
        self._rendered_by.pop(rid, None)
        metrics.IN_FLIGHT.labels("ingress").set(len(self.pending))
        if (deadline := self._deadlines.pop(rid, None)) is not None:
            deadline.cancel()
        if q.cut or q.nbytes >= _TRIM_BYTES:
            q.drop()
            self._trim_soon()

    def _trim_soon(self) -> None:
        """Gives the memory of a stream that held up to --max-stream-buffer back to the OS, once for the cut
        streams that end together: freed, its many small frames would leave the heap that much larger for
        good (glibc keeps them for reuse between the chunks still live)."""
        if not self._trim_due:
            self._trim_due = True
            asyncio.get_running_loop().call_later(_TRIM_AFTER_S, self._trim)

    def _trim(self) -> None:
        self._trim_due = False
        procs.trim_heap()

    def end(self, rid: str, q: FrameQueue, last) -> None:
        """Hands a request its last frame (an error) or the deadline's sentinel. A relay stuck in a send to a
        client that reads nothing would never see it: that response is cut instead."""
        if q.cut:
            return
        q.put_nowait(last)
        if q.stalled():
            self.cut(rid, q)

    def cut(self, rid: str, q: FrameQueue) -> None:
        """The client takes nothing of its response: end it (its relay aborts it in the engine) rather than hold
        what the client has not read without bound."""
        log.warning("response cut: its client reads too slowly", extra={"fields": {
            "request_id": rid, "queued_bytes": q.nbytes, "max_stream_buffer": self.cfg.max_stream_buffer}})
        q.cut = True
        q.drop()
        q.owner.cancel()

    def fail(self, rids: list[str], failure: Failure) -> None:
        for rid in rids:
            self._rendered_by.pop(rid, None)
            if (q := self.pending.get(rid)) is not None:
                self.end(rid, q, Frame(rid, b"", done=True, error=failure))

    # ---- the loops -------------------------------------------------------------

    def _read_frames(self) -> None:
        """Every message waiting in the inbox, each frame to its request's queue (or straight to its client),
        in one event-loop callback: no task or future per message. The socket's descriptor signals new
        messages only once all that waited was read, so one message's failure must not stop the rest."""
        for msg in self._inbox.drain():
            try:
                self._deliver(msg)
            except Exception:
                log.exception("ingress: delivering a message failed")

    def _deliver(self, msg: IngressInput) -> None:
        if not isinstance(msg, Frames):  # Rendered: these requests are in the engine's hands now
            for rid in msg.request_ids:
                self._rendered_by.pop(rid, None)
            return
        for frame in msg.frames:
            q = self.pending.get(frame.request_id)
            if q is None or q.cut:
                continue
            self._rendered_by.pop(frame.request_id, None)
            # A last frame always goes in: the request is done, nothing more can pile up behind it.
            if not frame.done and q.nbytes > self.cfg.max_stream_buffer and q.stalled():
                self.cut(frame.request_id, q)
            else:
                q.put_nowait(frame)

    async def _read_control(self) -> None:
        while True:
            msg = await self._control.get()
            if isinstance(msg, Drain):
                self.draining = True
            elif isinstance(msg, DrainTimedOut):
                self.fail(list(self.pending), Failure(
                    503, f"the server is shutting down and this request did not finish within its drain timeout "
                    f"({msg.timeout:g}s); retry it", "shutting_down"))
            elif isinstance(msg, EngineDied):
                self.engine_dead = True
                self.fail(list(self.pending), _ENGINE_DEAD)
            elif isinstance(msg, StageDied):
                self._stage_died(msg.role, msg.index)

    def _stage_died(self, role: str, index: int) -> None:
        """Fails the requests a dead render or postproc worker held (the supervisor restarts it)."""
        if role == "render":  # requests it was given that have not reached the engine
            rids = [rid for rid, k in self._rendered_by.items() if k == index]
        else:
            rids = [rid for rid in self.pending if shard_of(rid, self.cfg.postproc_workers) == index]
        self.fail(rids, Failure(500, f"the {role} worker handling this request died; retry it", "worker_died"))
        if rids:
            self._engine.put(Abort(rids))

    async def _report(self) -> None:
        while True:
            self._supervisor.put(IngressStatus(os.getpid(), len(self.pending)))
            await asyncio.sleep(_STATUS_INTERVAL_S)
