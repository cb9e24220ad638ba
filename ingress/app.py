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

from ingress.http import (SSE, BodyTimedOut, BodyTooLarge, authorized, read_body, respond, respond_error,
                          validation_error)
from ingress.metrics import render_metrics
from ingress.openapi import openapi_document
from ingress.server_options import raise_open_files_limit
from ipc.addresses import shard_of
from ipc.messages import (Abort, ControlInput, Drain, DrainTimedOut, Endpoint, EngineDied, EngineInput, Frame, Frames,
                          IngressInput, IngressStatus, RenderInput, RenderJob, StageDied, SupervisorInput)
from ipc.openai import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, error_body
from ipc.stats import EngineStats
from ipc.transport import AsyncPullChannel, PushChannel, SubChannel
from sluice import __version__, envs, metrics, procs
from sluice.config import ServerConfig
from sluice.logs import setup_logging

_STATUS_INTERVAL_S = 0.2
_HEALTH_GENERATE_TIMEOUT_S = 30.0
_DISCONNECTED = object()
_TIMED_OUT = object()
_STALL_S = 1.0  # a stream over --max-stream-buffer whose client took nothing for this long is cut
log = logging.getLogger("sluice.ingress")
_ENDPOINTS: dict[str, tuple[Endpoint, msgspec.json.Decoder, str]] = {
    "/v1/chat/completions": ("chat", msgspec.json.Decoder(ChatCompletionRequest), "chatcmpl-"),
    "/v1/completions": ("completions", msgspec.json.Decoder(CompletionRequest), "cmpl-"),
}
_ROUTES = frozenset(_ENDPOINTS) | {"/v1/models"}  # the /v1 paths requests_total names; every other one is "other"


class FrameQueue(asyncio.Queue):
    """One request's frames (and sentinels) on their way to its client, with the frame bytes waiting in it.

    `owner` is the task writing them out. Stuck in a send to a client that does not read, it sees neither
    the queue nor anything else: cancelling it is the one way to end that response."""

    def __init__(self, owner: asyncio.Task) -> None:
        super().__init__()
        self.owner = owner
        self.nbytes = 0
        self.sending_since: float | None = None  # when the owner's current send began (set around each send)
        self.cut = False  # the stream was cut for its slow client: drop its frames, the owner ends it

    def _put(self, item) -> None:
        if isinstance(item, Frame):
            self.nbytes += len(item.data)
        super()._put(item)

    def _get(self):
        item = super()._get()
        if isinstance(item, Frame):
            self.nbytes -= len(item.data)
        return item

    def stalled(self) -> bool:
        """The owner has been stuck in a send for a while: its client takes nothing. (A full queue alone is
        not enough: _read_frames does not yield while messages are ready, so a burst of them can fill a
        queue before its relay gets to run.)"""
        return self.sending_since is not None and time.monotonic() - self.sending_since > _STALL_S


class Ingress:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.names = set(cfg.served_model_names)
        self.address = cfg.addresses.ingress(os.getpid())
        self.pending: dict[str, FrameQueue] = {}
        self._deadlines: dict[str, asyncio.TimerHandle] = {}
        # This worker's share of --max-pending (the connections are spread over the workers).
        self.max_pending = -(-cfg.max_pending // cfg.ingress_workers)
        raise_open_files_limit(cfg)
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
            if not isinstance(msg, Frames):  # Rendered: these requests are in the engine's hands now
                for rid in msg.request_ids:
                    self._rendered_by.pop(rid, None)
                continue
            for frame in msg.frames:
                q = self.pending.get(frame.request_id)
                if q is None or q.cut:
                    continue
                self._rendered_by.pop(frame.request_id, None)
                # A last frame always goes in: the request is done, nothing more can pile up behind it.
                if not frame.done and q.nbytes > self.cfg.max_stream_buffer and q.stalled():
                    self._cut(frame.request_id, q)
                else:
                    q.put_nowait(frame)

    def _cut(self, rid: str, q: FrameQueue) -> None:
        """The client reads its stream slower than it comes: end it (its relay aborts it in the engine)
        rather than hold what the client has not read without bound."""
        q.cut = True
        q.owner.cancel()
        log.warning("stream cut: its client reads too slowly", extra={"fields": {
            "request_id": rid, "queued_bytes": q.nbytes, "max_stream_buffer": self.cfg.max_stream_buffer}})

    async def _read_control(self) -> None:
        while True:
            msg = await self._control.get()
            if isinstance(msg, Drain):
                self.draining = True
            elif isinstance(msg, DrainTimedOut):
                self._fail(list(self.pending), f"the server is shutting down and this request did not finish "
                           f"within its drain timeout ({msg.timeout:g}s); retry it", "shutting_down", 503)
            elif isinstance(msg, EngineDied):
                self.engine_dead = True
                self._fail(list(self.pending), "the engine process died; the server is restarting", "engine_dead")
            elif isinstance(msg, StageDied):
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

    def _fail(self, rids: list[str], message: str, code: str, status: int = 500) -> None:
        body = error_body(status, message, code=code)
        for rid in rids:
            self._rendered_by.pop(rid, None)
            if (q := self.pending.get(rid)) is not None:
                self._end(rid, q, Frame(rid, body, done=True, status=status))

    def _end(self, rid: str, q: FrameQueue, last) -> None:
        """Hands a request its last frame (an error) or the deadline's sentinel. A relay stuck in a send to a
        client that reads nothing would never see it: that response is cut instead."""
        if q.cut:
            return
        q.put_nowait(last)
        if q.stalled():
            self._cut(rid, q)

    def _submit(self, rid: str, endpoint: Endpoint, body: bytes) -> None:
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
                # by route, never by raw path: each label set is a series kept for the server's life
                endpoint = scope["path"] if scope["path"] in _ROUTES else "other"
                metrics.REQUESTS.labels(endpoint, str(status)).inc()
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
            body = await read_body(receive, limit, self.cfg.body_timeout)
        except BodyTooLarge:
            return await respond_error(send, 413, f"request body larger than {limit} bytes")
        except BodyTimedOut:
            return await respond_error(send, 408, f"the request body did not arrive within {self.cfg.body_timeout:g}s",
                                       code="timeout")
        except ConnectionResetError:
            return 0
        try:
            request = decoder.decode(body)
        except msgspec.MsgspecError as e:
            message, param = validation_error(e)
            return await respond_error(send, 400, message, param)
        except RecursionError:  # msgspec's guard: it stops at the interpreter's recursion limit
            return await respond_error(send, 400, "invalid JSON body: arrays or objects nested too deeply to parse")
        if request.model not in self.names:
            return await respond_error(send, 404, f"The model {request.model!r} does not exist; this server serves "
                                       f"{sorted(self.names)}", param="model", code="model_not_found")
        if self.draining or self.engine_dead:
            return await respond_error(send, 503, "the server is shutting down", extra_headers=[(b"retry-after", b"5")])
        if len(self.pending) >= self.max_pending:
            return await _respond_full(send)
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

    def _open(self, rid: str) -> FrameQueue:
        owner = asyncio.current_task()
        assert owner is not None, "opened from a request's handler task"
        q = FrameQueue(owner)
        self.pending[rid] = q
        metrics.IN_FLIGHT.labels("ingress").set(len(self.pending))
        if self.cfg.request_timeout:
            self._deadlines[rid] = asyncio.get_running_loop().call_later(self.cfg.request_timeout, self._end, rid, q,
                                                                         _TIMED_OUT)
        return q

    def _close(self, rid: str) -> None:
        del self.pending[rid]
        self._rendered_by.pop(rid, None)
        metrics.IN_FLIGHT.labels("ingress").set(len(self.pending))
        if (deadline := self._deadlines.pop(rid, None)) is not None:
            deadline.cancel()

    async def _relay(self, q: FrameQueue, send, stream: bool) -> tuple[bool, int]:
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
                q.sending_since = time.monotonic()  # (a body its client does not read can stall too)
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
                q.sending_since = time.monotonic()
                await send({"type": "http.response.body", "body": body, "more_body": not frame.done})
                q.sending_since = None
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
        except asyncio.CancelledError:
            if not q.cut:
                raise
            _uncancel()  # the cancel was ours (_cut): this request ends here, the response cut short
            return False, 200

    async def _health_generate(self, send) -> int:
        """One token through the whole pipeline: render, engine, postproc, back here."""
        if len(self.pending) >= self.max_pending:  # it takes a slot like any request: probes must not pile up
            return await _respond_full(send)
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


async def _respond_full(send) -> int:
    return await respond_error(send, 503, "the server is at capacity; retry shortly",
                               extra_headers=[(b"retry-after", b"1")])


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):  # 3.11+ counts cancels: a handled one is taken back
        task.uncancel()


async def _watch_disconnect(receive, q: asyncio.Queue) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            q.put_nowait(_DISCONNECTED)
            return


def create_app() -> Ingress:
    """granian's factory: one Ingress per worker process."""
    procs.die_with_parent()  # with granian's main process, which dies with the supervisor
    procs.set_title("sluice: ingress")
    path = envs.config_path()
    if not path:
        raise RuntimeError("SLUICE_CONFIG is not set: start the ingress through `sluice serve`")
    cfg = ServerConfig.load(path)
    setup_logging(f"ingress[{os.getpid()}]", cfg.log_format)
    return Ingress(cfg)
