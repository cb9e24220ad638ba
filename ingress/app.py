"""The ASGI app: routes, validation, and streaming frames back to the client.

Each request gets an asyncio.Queue; one reader task moves frames from this
worker's ZeroMQ socket into the queues.
"""
from __future__ import annotations

import asyncio
import os
import time
import uuid

import msgspec
import zmq
import zmq.asyncio

from ingress.http import SSE, BodyTooLarge, read_body, respond, respond_error, validation_error
from ingress.metrics import render_metrics
from ipc.messages import (Abort, Control, ControlInput, EngineInput, Frame, IngressInput, IngressStatus,
                          RenderInput, RenderJob, SupervisorInput)
from ipc.openai import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, error_body
from ipc.stats import EngineStats
from ipc.transport import AsyncPullChannel, PushChannel, SubChannel
from sluice import __version__, envs
from sluice.config import ServerConfig

MAX_BODY_BYTES = 64 << 20
_STATUS_INTERVAL_S = 0.2
_HEARTBEAT_STALE_S = 30.0
_DISCONNECTED = object()
_ENDPOINTS = {
    "/v1/chat/completions": ("chat", msgspec.json.Decoder(ChatCompletionRequest), "chatcmpl-"),
    "/v1/completions": ("completions", msgspec.json.Decoder(CompletionRequest), "cmpl-"),
}


class Ingress:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.names = set(cfg.served_model_names)
        self.address = cfg.addresses.ingress(os.getpid())
        self.pending: dict[str, asyncio.Queue] = {}
        self.draining = False
        self.engine_dead = False
        self._actx = zmq.asyncio.Context()
        self._ctx = zmq.Context()
        addr = cfg.addresses
        self._inbox: AsyncPullChannel[IngressInput] = AsyncPullChannel(self._actx, self.address, IngressInput)
        self._control: SubChannel[ControlInput] = SubChannel(self._actx, addr.control, ControlInput)
        self._render: PushChannel[RenderInput] = PushChannel(
            self._ctx, [addr.render(i) for i in range(cfg.render_workers)])
        self._engine: PushChannel[EngineInput] = PushChannel(self._ctx, addr.engine)
        self._supervisor: PushChannel[SupervisorInput] = PushChannel(self._ctx, addr.supervisor)
        self.stats = EngineStats(addr.stats_path)
        self._tasks: list[asyncio.Task] = []
        models = [ModelCard(n, int(time.time()), max_model_len=cfg.max_model_len, root=cfg.model_path)
                  for n in cfg.served_model_names]
        self._models_body = msgspec.json.encode(ModelList(models))

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(t()) for t in (self._read_frames, self._read_control, self._report)]

    async def _read_frames(self) -> None:
        while True:
            msg = await self._inbox.get()
            for frame in msg.frames:
                q = self.pending.get(frame.request_id)
                if q is not None:
                    q.put_nowait(frame)

    async def _read_control(self) -> None:
        while True:
            msg: Control = await self._control.get()
            if msg.event == "drain":
                self.draining = True
            elif msg.event == "engine_dead":
                self.engine_dead = True
                body = error_body(500, "the engine process died; the server is restarting", code="engine_dead")
                for rid, q in self.pending.items():
                    q.put_nowait(Frame(rid, body, done=True, status=500))

    async def _report(self) -> None:
        while True:
            self._supervisor.put(IngressStatus(os.getpid(), len(self.pending)))
            await asyncio.sleep(_STATUS_INTERVAL_S)

    def healthy(self) -> bool:
        s = self.stats.read()
        return not self.engine_dead and s["alive"] == 1 and time.time() - s["heartbeat"] < _HEARTBEAT_STALE_S

    # ---- ASGI ---------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        self.start()
        path, method = scope["path"], scope["method"]
        if path in _ENDPOINTS:
            if method != "POST":
                return await respond_error(send, 405, f"use POST for {path}")
            return await self._generate(path, receive, send)
        if method != "GET":
            return await respond_error(send, 405, f"{method} is not allowed on {path}")
        if path == "/v1/models":
            return await respond(send, 200, self._models_body)
        if path == "/health":
            ok = self.healthy()
            return await respond(send, 200 if ok else 503, b"{}" if ok else error_body(503, "engine unavailable"))
        if path == "/version":
            return await respond(send, 200, msgspec.json.encode({"version": __version__}))
        if path == "/metrics":
            return await respond(send, 200, render_metrics(self.stats.read()),
                                 [(b"content-type", b"text/plain; version=0.0.4")])
        return await respond_error(send, 404, f"no route for {path}", code="not_found")

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self.start()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _generate(self, path: str, receive, send) -> None:
        endpoint, decoder, prefix = _ENDPOINTS[path]
        try:
            body = await read_body(receive, MAX_BODY_BYTES)
        except BodyTooLarge:
            return await respond_error(send, 413, f"request body larger than {MAX_BODY_BYTES} bytes")
        except ConnectionResetError:
            return
        try:
            request = decoder.decode(body)
        except msgspec.MsgspecError as e:
            message, param = validation_error(e)
            return await respond_error(send, 400, message, param)
        if request.model not in self.names:
            return await respond_error(send, 404, f"The model {request.model!r} does not exist; this server serves "
                                       f"{sorted(self.names)}", param="model", code="model_not_found")
        if self.draining or self.engine_dead:
            return await respond_error(send, 503, "the server is shutting down", extra_headers=[(b"retry-after", b"5")])
        rid = prefix + uuid.uuid4().hex
        q: asyncio.Queue = asyncio.Queue()
        self.pending[rid] = q
        watcher = asyncio.create_task(_watch_disconnect(receive, q))
        try:
            self._render.put(RenderJob(rid, endpoint, body, self.address, time.time()))
            if not await self._relay(q, send, bool(request.stream)):
                self._engine.put(Abort([rid]))
        finally:
            watcher.cancel()
            del self.pending[rid]

    async def _relay(self, q: asyncio.Queue, send, stream: bool) -> bool:
        """Writes the request's frames to the client; False if the client went away first."""
        frame = await q.get()
        if frame is _DISCONNECTED:
            return False
        try:
            if frame.status != 200 or not stream:
                await respond(send, frame.status, frame.data)
                return True
            await send({"type": "http.response.start", "status": 200, "headers": SSE})
            while True:
                await send({"type": "http.response.body", "body": frame.data, "more_body": not frame.done})
                if frame.done:
                    return True
                frame = await q.get()
                if frame is _DISCONNECTED:
                    return False
                if frame.status != 200:  # an error after the stream began: say so in-band, then end
                    frame = Frame(frame.request_id, b"data: " + frame.data + b"\n\ndata: [DONE]\n\n", True)
        except OSError:
            return False


async def _watch_disconnect(receive, q: asyncio.Queue) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            q.put_nowait(_DISCONNECTED)
            return


def create_app() -> Ingress:
    """granian's factory: one Ingress per worker process."""
    path = envs.config_path()
    if not path:
        raise RuntimeError("SLUICE_CONFIG is not set: start the ingress through `sluice serve`")
    return Ingress(ServerConfig.load(path))
