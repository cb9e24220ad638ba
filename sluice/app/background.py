"""The background owner: one process that does the work no open connection waits for (Message Batches,
background responses). It reads that work from the state database, submits it to the render pool as an
ingress worker would (its own reply address, its own queues), behind interactive requests, and writes
the outcomes back. After a restart it picks up what was left: the database says what that is.

Each kind of work is a module in TASKS with `async def run(owner: Owner) -> None`, a loop of its own."""
from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import time
import uuid
from typing import AsyncGenerator

import zmq

from sluice.base.config import ServerConfig
from sluice.ingress.pipeline import DISCONNECTED, TIMED_OUT, Pipeline
from sluice.ipc.messages import Endpoint, Failure, Frame, Ready, RenderJob, SupervisorInput
from sluice.ipc.transport import PushChannel

log = logging.getLogger("sluice.app.background")
BACKGROUND_PRIORITY = 1 << 30  # behind any interactive request (lower is served first)
TASKS = ("sluice.state.batches", "sluice.state.responses")  # modules with `async def run(owner)`


class Owner:
    """What a background task gets: the configuration, and a way to run one request to its end."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.pipeline = Pipeline(cfg)
        self._slots = asyncio.Semaphore(cfg.background_concurrency)

    async def complete(self, endpoint: Endpoint, body: bytes, id_prefix: str) -> tuple[str, Frame]:
        """Runs one non-streaming request (a JSON body of `endpoint`'s dialect): its id and its last frame, a
        whole body or an error. Waits for a slot first (--background-concurrency)."""
        rid = id_prefix + uuid.uuid4().hex
        async with contextlib.aclosing(self.frames(endpoint, body, rid)) as frames:
            async for frame in frames:
                last = frame
        return rid, last

    async def frames(self, endpoint: Endpoint, body: bytes, rid: str) -> AsyncGenerator[Frame, None]:
        """Runs one request as `rid`, after waiting for a slot: its frames as they come (a streaming body's
        events, else one whole body), the last one done or an error. A caller that stops early closes the
        generator (contextlib.aclosing): the engine drops the request."""
        async with self._slots:
            while self.pipeline.draining or self.pipeline.engine_dead:
                await asyncio.sleep(1.0)  # (the server is going down: this work resumes after the restart)
            q = self.pipeline.open(rid)
            ended = False
            try:
                self.pipeline.submit(rid, RenderJob(rid, endpoint, body, self.pipeline.address, time.time(),
                                                    priority=BACKGROUND_PRIORITY))
                while not ended:
                    frame = await q.get()
                    if frame is TIMED_OUT or frame is DISCONNECTED:
                        yield Frame(rid, b"", True, Failure(504, "the request did not finish in time", "timeout"))
                        return
                    ended = frame.done
                    yield frame
            finally:
                self.pipeline.close(rid)
                if not ended:
                    self.pipeline.abort(rid)


async def _main(cfg: ServerConfig) -> None:
    owner = Owner(cfg)
    owner.pipeline.start()
    tasks = [asyncio.create_task(importlib.import_module(name).run(owner), name=name) for name in TASKS]
    PushChannel[SupervisorInput](zmq.Context.instance(), cfg.addresses.supervisor).put(
        Ready("background", 0, os.getpid()))
    for task in asyncio.as_completed(tasks):
        await task  # a task that fails takes the process down: the supervisor restarts it, it resumes
    await asyncio.Event().wait()  # (every task ended: the pipeline still answers the supervisor)


def run_background(cfg: ServerConfig) -> None:
    import uvloop

    uvloop.run(_main(cfg))
