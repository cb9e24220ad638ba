"""The ASGI app: routes, validation in each dialect, and streaming frames back to the client.

Each request gets a queue of its own (ingress/pipeline.py); one reader task moves frames from this
worker's ZeroMQ socket into the queues.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

import msgspec

import sluice.ingress.anthropic  # noqa: F401  (registers its dialect and routes)
import sluice.ingress.models  # noqa: F401  (registers its route)
import sluice.ingress.responses  # noqa: F401  (registers its dialect and routes)
import sluice.ingress.stored_chat  # noqa: F401  (registers its routes and keeper)
import sluice.ingress.tokenize  # noqa: F401  (registers its routes)
import sluice.ingress.worker_info  # noqa: F401  (registers its route)
from sluice import __version__
from sluice.base import envs, metrics, procs, tracing
from sluice.base.auth import CHALLENGE, MISSING_KEY, authorized
from sluice.base.checkpoint import sampling_defaults
from sluice.base.config import ServerConfig
from sluice.base.disagg import accepted as accepted_disagg
from sluice.base.logs import setup_logging
from sluice.ingress import middleware
from sluice.ingress.dialects import DIALECTS, KEEPERS, OPENAI_CHAT, OPENAI_COMPLETIONS, Dialect, Keep
from sluice.ingress.formats import BadMsgpack, accepts_msgpack, msgpack_as_json, msgpack_responses, sends_msgpack
from sluice.ingress.http import (JSON, SSE, BodyTimedOut, BodyTooLarge, capped, capped_failure, read_body, respond,
                                 respond_error, validation_error)
from sluice.ingress.metrics import render_metrics
from sluice.ingress.openapi import openapi_document
from sluice.ingress.pipeline import CLIENT_CLOSED, DISCONNECTED, TIMED_OUT, FrameQueue, Pipeline, ended_as
from sluice.ingress.routes import Request, Route, find
from sluice.ingress.server_options import raise_open_files_limit
from sluice.ipc.messages import Failure, Frame, RenderJob, TraceContext
from sluice.schemas.openai import ModelCard, ModelList, error_body

_HEALTH_GENERATE_TIMEOUT_S = 30.0
log = logging.getLogger("sluice.ingress")


class Ingress(Pipeline):
    def __init__(self, cfg: ServerConfig) -> None:
        # This worker's share of --max-pending (the connections are spread over the workers).
        super().__init__(cfg, share=cfg.ingress_workers)
        self.names = set(cfg.served_model_names)
        raise_open_files_limit(cfg)
        self.api_keys = [k.encode() for k in cfg.api_keys]
        defaults = sampling_defaults(cfg.model_path, cfg.generation_config)
        # The checkpoint's own time, so every ingress worker and every restart shows the same card.
        created = int(os.stat(cfg.model_path).st_mtime) if os.path.exists(cfg.model_path) else int(time.time())
        models = [ModelCard(n, created, max_model_len=cfg.max_model_len, root=cfg.model_path,
                            sampling_defaults=defaults) for n in cfg.served_model_names]
        self.models = {m.id: msgspec.json.encode(m) for m in models}
        self._models_body = msgspec.json.encode(ModelList(models))
        self._openapi_body = msgspec.json.encode(openapi_document())
        # A model whose serving extension reads its output from the token ids (gpt-oss through harmony) is
        # checked through a chat message: that rendering and that parsing are what could fail.
        self._health_chat = cfg.output_mode == "tokens"

    # ---- ASGI ---------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        self.start()
        status, label = 0, "other"
        try:
            status, label = await self._route(scope, receive, send)
        finally:
            if scope["path"].startswith("/v1/"):
                # by route template, never by raw path: each label set is a series kept for the server's life
                metrics.REQUESTS.labels(label, str(status)).inc()
                if status >= 400:
                    log.info(ended_as(status), extra={"fields": {"route": label, "status": status}})

    async def _route(self, scope, receive, send) -> tuple[int, str]:
        """Answers one HTTP request; returns the status it sent (499: the client left before its response ended,
        or before its body was all sent) and the route's template."""
        path, method = scope["path"], scope["method"]
        dialect = DIALECTS.get(path)
        routes = find(path) if dialect is None or method != "POST" else []  # (GET /v1/chat/completions lists)
        label = path if dialect is not None else routes[0][0].template if routes else "other"
        shape = dialect or next((r.dialect for r, _ in routes if r.dialect is not None), OPENAI_CHAT)
        send = shape.wrap_send(send)
        if accepts_msgpack(scope["headers"]):
            send = msgpack_responses(send)
        if not authorized(path, scope["headers"], self.api_keys, self.cfg.protect_metrics):
            return await self.respond_failure(send, shape, Failure(401, MISSING_KEY, "invalid_api_key"),
                                              [CHALLENGE]), label
        if dialect is not None and method == "POST":
            return await self.generate(dialect, receive, send, headers=scope["headers"]), label
        for r, params in routes:
            if r.method == method:
                return await self._handle(r, Request(scope, params), receive, send, shape), label
        if dialect is not None:
            return await self.respond_failure(send, dialect, Failure(405, f"use POST for {path}")), label
        if routes:
            allowed = ", ".join(sorted(r.method for r, _ in routes))
            return await self.respond_failure(send, shape, Failure(
                405, f"{method} is not allowed on {path}; use {allowed}")), label
        if method != "GET":
            return await respond_error(send, 405, f"{method} is not allowed on {path}"), "other"
        return await self._fixed(path, send), path if path == "/v1/models" else "other"

    async def _handle(self, r: Route, request: Request, receive, send, dialect: Dialect) -> int:
        """A route's handler. An exception it lets out before its response began is a 500 in the route's
        dialect (never granian's plain text); after, it cuts the connection, so that a response cut short is
        never taken for a whole one."""
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = True
            await send(message)
        try:
            return await r.handler(self, request, receive, tracked)
        except Exception:
            if started:
                raise
            log.exception("%s %s failed", r.method, r.template)
            return await self.respond_failure(send, dialect, Failure(
                500, f"internal error while serving {r.method} {r.template}", "internal_error"))

    async def _fixed(self, path: str, send) -> int:
        if path == "/v1/models":
            return await respond(send, 200, self._models_body)
        if path in ("/health", "/ready"):
            problem = self.health_problem()
            ok = problem is None and not (path == "/ready" and self.draining)
            body = b"{}" if ok else error_body(503, problem or "the server is shutting down")
            return await respond(send, 200 if ok else 503, body)
        if path == "/health_generate":
            return await self._health_generate(send)
        if path == "/openapi.json":
            return await respond(send, 200, self._openapi_body)
        if path == "/version":
            return await respond(send, 200, msgspec.json.encode({"version": __version__}))
        if path in ("/metrics", "/prometheus/metrics"):  # (the second: trtllm-serve's)
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

    # ---- generation -------------------------------------------------------------

    async def read_request(self, dialect: Dialect, receive, send,
                           headers: list[tuple[bytes, bytes]]) -> tuple[Any, bytes] | int:
        """The request body, validated as the dialect's Struct, and its JSON (a msgpack body's JSON form, which
        is what goes on to render); or the status of the error sent instead."""
        limit = self.cfg.max_request_bytes
        try:
            body = await read_body(receive, limit, self.cfg.body_timeout)
        except BodyTooLarge:
            return await self.respond_failure(send, dialect, Failure(413, f"request body larger than {limit} bytes"))
        except BodyTimedOut:
            return await self.respond_failure(send, dialect, Failure(
                408, f"the request body did not arrive within {self.cfg.body_timeout:g}s", "timeout"))
        except ConnectionResetError:  # (it left while sending its body: nothing can be answered)
            return CLIENT_CLOSED
        form = "msgpack" if sends_msgpack(headers) else "JSON"
        try:
            if form == "msgpack":
                body = msgpack_as_json(body)
            request = dialect.decoder.decode(body)
            if dialect.check is not None:
                dialect.check(request)
            return request, body
        except BadMsgpack as e:
            return await self.respond_failure(send, dialect, Failure(400, capped(f"invalid msgpack body: {e}")))
        except msgspec.MsgspecError as e:
            message, param = validation_error(e)
            return await self.respond_failure(send, dialect, Failure(400, message, param=param))
        except RecursionError:  # msgspec's guard: it stops at the interpreter's recursion limit
            return await self.respond_failure(send, dialect, Failure(
                400, f"invalid {form} body: arrays or objects nested too deeply to parse"))

    def refusal(self, model: str) -> Failure | None:
        """Why a request for `model` cannot be taken now, if it cannot."""
        if model not in self.names:
            return Failure(404, f"The model {model!r} does not exist; this server serves {sorted(self.names)}",
                           "model_not_found", "model")
        if self.draining or self.engine_dead:
            return Failure(503, "the server is shutting down")
        if self.full:
            return Failure(503, "the server is at capacity; retry shortly")
        return None

    async def generate(self, dialect: Dialect, receive, send, body: bytes | None = None, request: Any = None,
                       headers: list[tuple[bytes, bytes]] | None = None, rid: str | None = None,
                       keep: Keep | None = None, trace: TraceContext | None = None) -> int:
        """One generation request from its HTTP body to its last frame (a route that read and checked the
        body itself passes it on, with its id and what keeps its response where it chose them). `headers`: the
        request's, where disaggregated_params and the trace context may come from (`trace`: the trace context
        of a route that passes no headers). A request that asks to be stored (`store`) is kept by its
        dialect's keeper (KEEPERS)."""
        if body is None:
            got = await self.read_request(dialect, receive, send, headers or [])
            if isinstance(got, int):
                return got
            request, body = got
        if (refused := self.refusal(request.model)) is not None:
            return await self.respond_failure(send, dialect, refused)
        disagg = accepted_disagg(request, headers or [], self.cfg, body)
        if isinstance(disagg, Failure):
            return await self.respond_failure(send, dialect, disagg)
        if keep is None and getattr(request, "store", None) and (keeper := KEEPERS.get(dialect.endpoint)):
            if isinstance(kept := await keeper(self, request), Failure):
                return await self.respond_failure(send, dialect, kept)
            keep = kept
        rid = rid or dialect.id_prefix + uuid.uuid4().hex
        q = self.open(rid)
        watcher = asyncio.create_task(_watch_disconnect(receive, q))
        try:
            self.submit(rid, RenderJob(rid, dialect.endpoint, body, self.address, time.time(), disagg=disagg,
                                       trace=trace or tracing.from_headers(headers or [])))
            # a context_only answer is one body, whatever the client's request asked: the orchestrator reads it
            stream = dialect.streams(request) and (disagg is None or disagg.request_type != "context_only")
            delivered, status = await self._relay(q, send, dialect, stream, rid, keep)
            if not delivered:
                self.abort(rid)
            return status
        finally:
            watcher.cancel()
            self.close(rid)

    async def respond_failure(self, send, dialect: Dialect, failure: Failure,
                              headers: list[tuple[bytes, bytes]] | None = None) -> int:
        """The failure as a whole response in the dialect's shape (503s say when to retry)."""
        headers = JSON + (headers or [])
        failure = capped_failure(failure)  # (one that echoes a client's input)
        if failure.status == 503:
            headers.append((b"retry-after", b"5" if self.draining else b"1"))
        return await respond(send, failure.status, dialect.errors.body(failure), headers)

    def _timeout(self) -> Failure:
        return Failure(504, f"the request did not finish within {self.cfg.request_timeout:g}s", "timeout")

    async def _relay(self, q: FrameQueue, send, dialect: Dialect, stream: bool, rid: str,
                     keep: Keep | None = None) -> tuple[bool, int]:
        """Writes the request's frames to the client, its last one kept first where the request is stored
        (`keep`: one that cannot be stored goes out as the error instead). Returns whether it got its last
        frame (if not: client gone, deadline passed, so the engine must drop it) and the status sent."""
        began = False  # the stream began before its first frame (keepalives)
        sequence = 0  # the number the stream's next event takes (a dialect that numbers them: Frame.sequence)
        if stream and dialect.keepalive:
            frame, began = await self._keep_alive(q, send, dialect, rid)
        else:
            frame = await q.get()
        if frame is DISCONNECTED:
            return False, CLIENT_CLOSED
        if began:
            frame = self._in_stream(frame, dialect, sequence)
        elif frame is TIMED_OUT:
            return False, await self.respond_failure(send, dialect, self._timeout())
        try:
            if frame.error is not None and not began:
                return True, await self.respond_failure(send, dialect, frame.error)
            if not stream:
                if keep is not None and (unkept := await keep(frame)) is not None:
                    return True, await self.respond_failure(send, dialect, unkept)
                q.sending_since = time.monotonic()  # (a body its client does not read can stall too)
                return True, await respond(send, 200, frame.data)
            if not began:
                await send({"type": "http.response.start", "status": 200, "headers": SSE + dialect.stream_headers})
            q.writer = send  # frames that come while this task waits go straight out
            while True:
                # Frames that queued up while this one was sent go out in one write: the same events, fewer
                # sends (the ingress falls behind under load). A sentinel or an error stops the merge.
                parts, after = [frame.data], None
                while not frame.done and not q.empty():
                    after = q.get_nowait()
                    if not isinstance(after, Frame) or after.error is not None:
                        break
                    frame, after = after, None
                    parts.append(frame.data)
                if frame.done and keep is not None and (unkept := await keep(frame)) is not None and \
                        frame.error is None:  # (the closing event goes: the error takes its place)
                    parts[-1] = frame.data[:len(frame.data) - sum(frame.sizes[-1:])] + dialect.errors.stream(
                        unkept, max(frame.sequence - 1, 0))
                body = parts[0] if len(parts) == 1 else b"".join(parts)
                q.sending_since = time.monotonic()
                await send({"type": "http.response.body", "body": body, "more_body": not frame.done})
                q.sending_since = None
                sequence = frame.sequence
                if frame.done:
                    return frame.error is None, 200
                frame = after if after is not None else await q.get()
                if frame is DISCONNECTED:
                    return False, CLIENT_CLOSED
                frame = self._in_stream(frame, dialect, sequence)
        except OSError:
            return False, CLIENT_CLOSED
        except asyncio.CancelledError:
            if not q.cut:
                raise
            _uncancel()  # the cancel was ours (a cut): this request ends here, the response cut short
            return False, CLIENT_CLOSED

    def _in_stream(self, frame: Frame | object, dialect: Dialect, sequence: int) -> Frame:
        """A frame (or the deadline) for a stream that began after `sequence` events: an error is said in-band,
        and ends it."""
        if frame is TIMED_OUT:
            return Frame("", dialect.errors.stream(self._timeout(), sequence), True, self._timeout(), sequence=sequence)
        assert isinstance(frame, Frame)
        if frame.error is not None:
            return Frame(frame.request_id, dialect.errors.stream(frame.error, sequence), True, frame.error,
                         sequence=sequence)
        return frame

    async def _keep_alive(self, q: FrameQueue, send, dialect: Dialect, rid: str) -> tuple[Any, bool]:
        """A stream's first frame (or sentinel), and whether the stream began while it waited: once the request
        is rendered (no 4xx can come any more), every keepalive_s without a frame sends the dialect's keepalive
        event, the stream's start first."""
        began = False
        while True:
            try:
                return await asyncio.wait_for(q.get(), dialect.keepalive_s), began
            except asyncio.TimeoutError:
                if rid in self._rendered_by:
                    continue
            try:
                if not began:
                    await send({"type": "http.response.start", "status": 200,
                                "headers": SSE + dialect.stream_headers})
                    began = True
                await send({"type": "http.response.body", "body": dialect.keepalive, "more_body": True})
            except OSError:
                return DISCONNECTED, began

    async def _health_generate(self, send) -> int:
        """One token through the whole pipeline: render, engine, postproc, back here."""
        if self.full:  # it takes a slot like any request: probes must not pile up
            return await self.respond_failure(send, OPENAI_COMPLETIONS, Failure(
                503, "the server is at capacity; retry shortly"))
        rid = "health-" + uuid.uuid4().hex
        q = self.open(rid)
        t0 = time.perf_counter()
        try:
            self.submit(rid, health_job(rid, self.cfg.served_model_names[0], self._health_chat, self.address))
            frame = await asyncio.wait_for(q.get(), _HEALTH_GENERATE_TIMEOUT_S)
            ok = isinstance(frame, Frame) and frame.error is None
        except asyncio.TimeoutError:
            ok = False
            self.abort(rid)
        finally:
            self.close(rid)
        if ok:
            return await respond(send, 200, msgspec.json.encode({"latency_ms": (time.perf_counter() - t0) * 1000}))
        return await respond_error(send, 503, "a one-token generation did not come back")


def health_job(rid: str, model: str, chat: bool, reply_to: str) -> RenderJob:
    """/health_generate's request: one token. With `chat` (a model whose output is read from its token ids:
    gpt-oss through harmony), the token of a chat message, as the seeds do: rendered by the model's extension
    and read by its token parser, so that a fault there fails the check."""
    if chat:
        return RenderJob(rid, "chat", msgspec.json.encode({"model": model, "max_tokens": 1,
                                                            "messages": [{"role": "user", "content": "hi"}]}),
                         reply_to, time.time())
    body = msgspec.json.encode({"model": model, "prompt": [0], "max_tokens": 1, "ignore_eos": True})
    return RenderJob(rid, "completions", body, reply_to, time.time())


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):  # 3.11+ counts cancels: a handled one is taken back
        task.uncancel()


async def _watch_disconnect(receive, q: FrameQueue) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            q.put_nowait(DISCONNECTED)
            return


def create_app() -> Any:
    """granian's factory: one Ingress per worker process, inside the --middleware given."""
    procs.die_with_parent()  # with granian's main process, which dies with the supervisor
    procs.set_title("sluice: ingress")
    path = envs.config_path()
    if not path:
        raise RuntimeError("SLUICE_CONFIG is not set: start the ingress through `sluice serve`")
    cfg = ServerConfig.load(path)
    setup_logging(f"ingress[{os.getpid()}]", cfg.log_format)
    return middleware.wrapped(Ingress(cfg), cfg.middleware)
