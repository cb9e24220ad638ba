"""The ASGI app: routes, validation, and streaming frames back to the client.

Each request gets an asyncio.Queue; one reader task moves frames from this
worker's ZeroMQ socket into the queues.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid

import msgspec
import zmq
import zmq.asyncio

from ingress.http import SSE, BodyTooLarge, authorized, read_body, respond, respond_error, validation_error
from ingress.metrics import render_metrics
from ingress.openapi import openapi_document
from ipc.addresses import shard_of
from ipc.messages import (Abort, Control, ControlInput, EngineInput, Frame, IngressInput, IngressStatus,
                          RenderInput, RenderJob, SupervisorInput)
from ipc.openai import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, error_body
from ipc.stats import EngineStats
from ipc.transport import AsyncPullChannel, PushChannel, SubChannel
from sluice import __version__, envs, metrics
from sluice.config import ServerConfig
from sluice.logs import setup_logging

_STATUS_INTERVAL_S = 0.2
_HEALTH_GENERATE_TIMEOUT_S = 30.0
_DISCONNECTED = object()
_TIMED_OUT = object()
log = logging.getLogger("sluice.ingress")
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
        self._deadlines: dict[str, asyncio.TimerHandle] = {}
        # This worker's share of --max-pending (the connections are spread over the workers).
        self.max_pending = -(-cfg.max_pending // cfg.ingress_workers)
        self.api_keys = [k.encode() for k in cfg.api_keys]
        self.draining = False
        self.engine_dead = False
        self._actx = zmq.asyncio.Context()
        self._ctx = zmq.Context()
        addr = cfg.addresses
        self._inbox: AsyncPullChannel[IngressInput] = AsyncPullChannel(self._actx, self.address, IngressInput)
        self._control: SubChannel[ControlInput] = SubChannel(self._actx, addr.control, ControlInput)
        # One channel per render worker, dealt round-robin, so a dead worker's requests are known.
        self._renders: list[PushChannel[RenderInput]] = [PushChannel(self._ctx, addr.render(i))
                                                         for i in range(cfg.render_workers)]
        self._next_render = 0
        self._rendered_by: dict[str, int] = {}  # request -> render worker, until its first frame
        self._engine: PushChannel[EngineInput] = PushChannel(self._ctx, addr.engine)
        self._supervisor: PushChannel[SupervisorInput] = PushChannel(self._ctx, addr.supervisor)
        self.stats = EngineStats(addr.stats_path)
        self._tasks: list[asyncio.Task] = []
        models = [ModelCard(n, int(time.time()), max_model_len=cfg.max_model_len, root=cfg.model_path)
                  for n in cfg.served_model_names]
        self._models_body = msgspec.json.encode(ModelList(models))
        self._openapi_body = msgspec.json.encode(openapi_document())

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(t()) for t in (self._read_frames, self._read_control, self._report)]

    async def _read_frames(self) -> None:
        while True:
            msg = await self._inbox.get()
            for frame in msg.frames:
                q = self.pending.get(frame.request_id)
                if q is not None:
                    self._rendered_by.pop(frame.request_id, None)
                    q.put_nowait(frame)

    async def _read_control(self) -> None:
        while True:
            msg: Control = await self._control.get()
            if msg.event == "drain":
                self.draining = True
            elif msg.event == "engine_dead":
                self.engine_dead = True
                self._fail(list(self.pending), "the engine process died; the server is restarting", "engine_dead")
            elif msg.event == "stage_died":
                self._stage_died(msg.role, msg.index)

    def _stage_died(self, role: str, index: int) -> None:
        """Fails the requests a dead render or postproc worker held (the supervisor restarts it)."""
        if role == "render":  # requests it was given that have not produced a frame yet
            rids = [rid for rid, k in self._rendered_by.items() if k == index]
        else:
            rids = [rid for rid in self.pending if shard_of(rid, self.cfg.postproc_workers) == index]
        self._fail(rids, f"the {role} worker handling this request died; retry it", "worker_died")
        if rids:
            self._engine.put(Abort(rids))

    def _fail(self, rids: list[str], message: str, code: str) -> None:
        body = error_body(500, message, code=code)
        for rid in rids:
            self._rendered_by.pop(rid, None)
            if (q := self.pending.get(rid)) is not None:
                q.put_nowait(Frame(rid, body, done=True, status=500))

    def _submit(self, rid: str, endpoint: str, body: bytes) -> None:
        k = self._next_render = (self._next_render + 1) % len(self._renders)
        self._rendered_by[rid] = k
        self._renders[k].put(RenderJob(rid, endpoint, body, self.address, time.time()))

    async def _report(self) -> None:
        while True:
            self._supervisor.put(IngressStatus(os.getpid(), len(self.pending)))
            await asyncio.sleep(_STATUS_INTERVAL_S)

    def healthy(self) -> bool:
        """The engine is alive and made progress (or idled, answering) within the stall timeout."""
        s = self.stats.read()
        return not self.engine_dead and s["alive"] == 1 and time.time() - s["heartbeat"] < self.cfg.stall_timeout


    # ---- ASGI ---------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        self.start()
        status = 0
        try:
            status = await self._route(scope, receive, send)
        finally:
            if scope["path"].startswith("/v1/"):
                metrics.REQUESTS.labels(scope["path"], str(status)).inc()
                if status >= 400:
                    log.info("request refused", extra={"fields": {"path": scope["path"], "status": status}})

    async def _route(self, scope, receive, send) -> int:
        """Answers one HTTP request; returns the status it sent (0: none, the client left first)."""
        path, method = scope["path"], scope["method"]
        if not authorized(path, scope["headers"], self.api_keys, self.cfg.protect_metrics):
            return await respond_error(send, 401, "missing or invalid API key: send 'Authorization: Bearer KEY'",
                                       code="invalid_api_key", extra_headers=[(b"www-authenticate", b"Bearer")])
        if path in _ENDPOINTS:
            if method != "POST":
                return await respond_error(send, 405, f"use POST for {path}")
            return await self._generate(path, receive, send)
        if method != "GET":
            return await respond_error(send, 405, f"{method} is not allowed on {path}")
        if path == "/v1/models":
            return await respond(send, 200, self._models_body)
        if path in ("/health", "/ready"):
            ok = self.healthy() and not (path == "/ready" and self.draining)
            return await respond(send, 200 if ok else 503, b"{}" if ok else error_body(503, "engine unavailable"))
        if path == "/health_generate":
            return await self._health_generate(send)
        if path == "/openapi.json":
            return await respond(send, 200, self._openapi_body)
        if path == "/version":
            return await respond(send, 200, msgspec.json.encode({"version": __version__}))
        if path == "/metrics":
            return await respond(send, 200, render_metrics(self.stats.read),
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

    async def _generate(self, path: str, receive, send) -> int:
        endpoint, decoder, prefix = _ENDPOINTS[path]
        limit = self.cfg.max_request_bytes
        try:
            body = await read_body(receive, limit)
        except BodyTooLarge:
            return await respond_error(send, 413, f"request body larger than {limit} bytes")
        except ConnectionResetError:
            return 0
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
        if len(self.pending) >= self.max_pending:
            return await respond_error(send, 503, "the server is at capacity; retry shortly",
                                       extra_headers=[(b"retry-after", b"1")])
        rid = prefix + uuid.uuid4().hex
        q = self._open(rid)
        watcher = asyncio.create_task(_watch_disconnect(receive, q))
        try:
            self._submit(rid, endpoint, body)
            delivered, status = await self._relay(q, send, bool(request.stream))
            if not delivered:
                self._engine.put(Abort([rid]))
            return status
        finally:
            watcher.cancel()
            self._close(rid)

    def _open(self, rid: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self.pending[rid] = q
        metrics.IN_FLIGHT.labels("ingress").set(len(self.pending))
        if self.cfg.request_timeout:
            self._deadlines[rid] = asyncio.get_running_loop().call_later(self.cfg.request_timeout, q.put_nowait,
                                                                         _TIMED_OUT)
        return q

    def _close(self, rid: str) -> None:
        del self.pending[rid]
        self._rendered_by.pop(rid, None)
        metrics.IN_FLIGHT.labels("ingress").set(len(self.pending))
        if (deadline := self._deadlines.pop(rid, None)) is not None:
            deadline.cancel()

    async def _relay(self, q: asyncio.Queue, send, stream: bool) -> tuple[bool, int]:
        """Writes the request's frames to the client. Returns whether it got its last frame (if not: client
        gone, deadline passed, so the engine must drop it) and the status sent."""
        frame = await q.get()
        if frame is _DISCONNECTED:
            return False, 0
        if frame is _TIMED_OUT:
            return False, await respond_error(send, 504, f"the request did not finish within "
                                              f"{self.cfg.request_timeout}s", code="timeout")
        try:
            if frame.status != 200 or not stream:
                return True, await respond(send, frame.status, frame.data)
            await send({"type": "http.response.start", "status": 200, "headers": SSE})
            while True:
                # Frames that queued up while this one was sent go out in one write: the same events, fewer
                # sends (the ingress falls behind under load). A sentinel or an error stops the merge.
                parts, after = [frame.data], None
                while not frame.done and not q.empty():
                    after = q.get_nowait()
                    if not isinstance(after, Frame) or after.status != 200:
                        break
                    frame, after = after, None
                    parts.append(frame.data)
                body = parts[0] if len(parts) == 1 else b"".join(parts)
                await send({"type": "http.response.body", "body": body, "more_body": not frame.done})
                if frame.done:
                    return frame.status == 200, 200
                frame = after if after is not None else await q.get()
                if frame is _DISCONNECTED:
                    return False, 200
                if frame is _TIMED_OUT:
                    body = error_body(504, f"the request did not finish within {self.cfg.request_timeout}s",
                                      code="timeout")
                    frame = Frame("", b"data: " + body + b"\n\ndata: [DONE]\n\n", True, 504)
                elif frame.status != 200:  # an error after the stream began: say so in-band, then end
                    frame = Frame(frame.request_id, b"data: " + frame.data + b"\n\ndata: [DONE]\n\n", True,
                                  frame.status)
        except OSError:
            return False, 200

    async def _health_generate(self, send) -> int:
        """One token through the whole pipeline: render, engine, postproc, back here."""
        rid = "health-" + uuid.uuid4().hex
        q = self._open(rid)
        body = msgspec.json.encode({"model": self.cfg.served_model_names[0], "prompt": [0], "max_tokens": 1,
                                    "ignore_eos": True})
        t0 = time.perf_counter()
        try:
            self._submit(rid, "completions", body)
            frame = await asyncio.wait_for(q.get(), _HEALTH_GENERATE_TIMEOUT_S)
            ok = isinstance(frame, Frame) and frame.status == 200
        except asyncio.TimeoutError:
            ok = False
            self._engine.put(Abort([rid]))
        finally:
            self._close(rid)
        if ok:
            return await respond(send, 200, msgspec.json.encode({"latency_ms": (time.perf_counter() - t0) * 1000}))
        return await respond_error(send, 503, "a one-token generation did not come back")


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
    cfg = ServerConfig.load(path)
    setup_logging(f"ingress[{os.getpid()}]", cfg.log_format)
    return Ingress(cfg)
