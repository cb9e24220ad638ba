"""A request that passes the door as the engine dies, after the supervisor's EngineDied failed what was in
flight, is failed too (the soak's one lost request: it waited for frames that never came, and granian's stop
closed its connection with no answer)."""
from __future__ import annotations

import asyncio

from sluice.base.config import ServerConfig
from sluice.ingress.pipeline import Pipeline
from sluice.ipc.messages import Frame


def _pipeline(engine_dead: bool) -> Pipeline:
    p = object.__new__(Pipeline)  # (no sockets: open() and fail() touch only the request table)
    p.cfg = ServerConfig(model="m", served_model_names=["m"], request_timeout=0)
    p.pending, p._rendered_by, p._deadlines, p.engine_dead = {}, {}, {}, engine_dead
    return p


def test_a_request_opened_after_the_engine_died_gets_the_engine_dead_error():
    async def opened(engine_dead: bool):
        q = _pipeline(engine_dead).open("chatcmpl-1")
        return q.get_nowait() if not q.empty() else None

    frame = asyncio.run(opened(True))
    assert isinstance(frame, Frame) and frame.done and frame.error.status == 500
    assert frame.error.code == "engine_dead"
    assert asyncio.run(opened(False)) is None
