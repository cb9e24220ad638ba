"""Render process: decode a job, run the chat core (within --render-timeout, and
only while its client waits), send the engine request (or the error straight back
to the ingress worker)."""
from __future__ import annotations

import logging
import os
from collections import defaultdict, deque
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import msgspec
import zmq

from sluice.base import hooks, metrics
from sluice.base.checkpoint import sampling_defaults
from sluice.base.config import ServerConfig
from sluice.ipc.messages import (EngineInput, EngineRequest, Failure, Frame, Frames, IngressInput, PostprocSpec, Ready,
                                 Rendered, RenderInput, RenderJob, SupervisorInput, bytes_to_ids)
from sluice.ipc.stats import BEAT_S, StageClocks
from sluice.ipc.transport import PullChannel, PushChannel, PushPool
from sluice.render import deadline
from sluice.render.core import ChatCore
from sluice.render.diagnostics import Fingerprints
from sluice.render.errors import RequestError
from sluice.render.extensions import extension_for, options_of
from sluice.render.structured import GrammarCompiler, GrammarLimits
from sluice.render.tokenizer import load_tokenizer

log = logging.getLogger("sluice.render")
T = TypeVar("T")
_spec_decoder = msgspec.msgpack.Decoder(PostprocSpec)


def build_core(cfg: ServerConfig) -> ChatCore:
    bundle = load_tokenizer(Path(cfg.model_path), cfg.chat_template)
    hf = cfg.hf_config()
    return ChatCore(extension_for(hf, bundle, options_of(cfg)), bundle, max_model_len=cfg.max_model_len,
                    model_vocab_size=hf["vocab_size"], num_shards=cfg.postproc_workers,
                    grammars=GrammarCompiler(cfg.model_path, hf["vocab_size"], grammar_limits(cfg),
                                             cfg.grammar_backend),
                    perf_metrics=cfg.perf_metrics, stream_interval=cfg.stream_interval,
                    sampling_defaults=sampling_defaults(cfg.model_path, cfg.generation_config),
                    fingerprints=Fingerprints(cfg))


def grammar_limits(cfg: ServerConfig) -> GrammarLimits:
    return GrammarLimits(compile_timeout=cfg.grammar_compile_timeout, memory=cfg.grammar_memory,
                         max_grammar_bytes=cfg.grammar_max_bytes)


def run_render(cfg: ServerConfig, index: int) -> None:
    core = build_core(cfg)
    ctx = zmq.Context()
    addr = cfg.addresses
    jobs: PullChannel[RenderInput] = PullChannel(ctx, addr.render(index), RenderInput)
    engine: PushChannel[EngineInput] = PushChannel(ctx, addr.engine, **cfg.bulk())
    replies: PushPool[IngressInput] = PushPool(ctx)
    clocks = StageClocks(addr.stage_clocks_path, cfg.render_workers, cfg.postproc_workers)
    hook = hooks.load(cfg.request_hook, "--request-hook") if cfg.request_hook else None
    worker = RenderWorker(core, jobs, cfg.render_timeout, hook)
    PushChannel[SupervisorInput](ctx, addr.supervisor).put(Ready("render", index, os.getpid()))
    while True:
        clocks.beat("render", index)
        if not worker.wait(BEAT_S):
            continue
        rendered: dict[str, list[str]] = defaultdict(list)  # ingress address -> requests now in the engine
        for job in worker.batch():
            clocks.beat("render", index)  # (a job begins: one that takes past its stall limit is stuck)
            metrics.IN_FLIGHT.labels("render").set(worker.waiting + 1)
            if job.answer != "engine":
                replies.get(job.reply_to).put(Frames([worker.answer(job)]))
                continue
            request = worker.render(job)
            if isinstance(request, Frame):
                replies.get(job.reply_to).put(Frames([request]))
            else:
                engine.put(request)  # (outside the render's deadline: a send is never cut in half)
                rendered[job.reply_to].append(job.request_id)
        for address, rids in rendered.items():
            replies.get(address).put(Rendered(rids))
        metrics.IN_FLIGHT.labels("render").set(0)


class RenderWorker:
    """A render worker's jobs: those waiting, and the one rendering, each within --render-timeout; an abort
    (its client left) drops a waiting job, and stops the one rendering (render/deadline.py)."""

    def __init__(self, core: ChatCore, jobs: PullChannel[RenderInput], timeout: float,
                 hook: hooks.RequestHook | None = None) -> None:
        self.core, self.jobs, self.timeout = core, jobs, timeout
        self.hook = hook  # --request-hook
        self._waiting: deque[RenderJob] = deque()
        self._dropped: set[str] = set()  # aborted jobs among those waiting

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def wait(self, timeout: float) -> bool:
        """Whether jobs wait, once what came within `timeout` seconds is taken in."""
        if not self._waiting and (msg := self.jobs.get(timeout)) is not None:
            self._take(msg)
        self.take()
        return bool(self._waiting)

    def take(self) -> None:
        """Takes in every message waiting now: a job joins the queue, an abort ends its job."""
        for msg in self.jobs.drain():
            self._take(msg)

    def _take(self, msg: RenderInput) -> None:
        if isinstance(msg, RenderJob):
            self._waiting.append(msg)
            return
        for rid in msg.request_ids:  # (a job already rendered: the engine has the abort too)
            deadline.abort(rid)
            if any(job.request_id == rid for job in self._waiting):
                self._dropped.add(rid)

    def batch(self) -> Iterator[RenderJob]:
        """The jobs waiting now, less those aborted before their turn (jobs that come meanwhile wait for the
        next batch, whose Rendered message they go in)."""
        for _ in range(len(self._waiting)):
            job = self._waiting.popleft()
            if job.request_id in self._dropped:
                self._dropped.discard(job.request_id)
                continue
            yield job
            self.take()

    def render(self, job: RenderJob) -> EngineRequest | Frame:
        """The job's engine request, or the frame that answers it instead (why it cannot be served)."""
        request = self._watched(job, lambda: self._hooked(self.core.render(job)))
        return _failed(job, request) if isinstance(request, RequestError) else request

    def _hooked(self, request: EngineRequest) -> EngineRequest:
        """The request as --request-hook leaves it (RequestError where it refuses it, or fails)."""
        if self.hook is None:
            return request
        spec = _spec_decoder.decode(request.postproc_spec)
        seen = hooks.RenderedRequest(request.request_id, spec.endpoint, spec.model, spec.user,
                                     bytes_to_ids(request.prompt_token_ids).tolist(), request.sampling,
                                     self.core.max_model_len)
        try:
            sampling = hooks.hooked_sampling(self.hook, seen)
        except hooks.Refused as e:
            raise RequestError(400, e.message, code="refused_by_request_hook") from None
        except hooks.HookError as e:
            log.error("%s: %s", request.request_id, e)
            raise RequestError(500, "internal error: the server's --request-hook failed on this request",
                               code="internal_error") from None
        return request if sampling is request.sampling else msgspec.structs.replace(request, sampling=sampling)

    def answer(self, job: RenderJob) -> Frame:
        """The answer of a job that asks the render alone (RenderJob.answer), or why it cannot be given."""
        body = self._watched(job, lambda: _ANSWERS[job.answer](self.core, job))
        if isinstance(body, RequestError):
            return _failed(job, body)
        return Frame(job.request_id, msgspec.json.encode(body), done=True)

    def _watched(self, job: RenderJob, fn: Callable[[], T]) -> T | RequestError:
        try:
            with deadline.watched(job.request_id, self.timeout, self.take):
                return _guarded(job, fn)
        except deadline.RenderStopped as e:
            if e.reason == "aborted":  # (nobody waits for it: the answer only closes the books)
                log.info("render of %s stopped: its request was aborted", job.request_id)
                return RequestError(499, "the request was aborted while it rendered", code="aborted")
            log.warning("render of %s stopped at its deadline (--render-timeout %gs)", job.request_id, self.timeout)
            return RequestError(408, f"rendering the request took longer than the server's --render-timeout "
                                f"({self.timeout:g}s); send a shorter one", code="render_timeout")


_ANSWERS: dict[str, Callable[[ChatCore, RenderJob], object]] = {
    "count": lambda core, job: {"input_tokens": core.count(job)},
    "tokens": lambda core, job: core.tokenized(job),
    "text": lambda core, job: core.detokenized(job),
}


def _failed(job: RenderJob, error: RequestError) -> Frame:
    return Frame(job.request_id, b"", done=True, error=Failure(error.status, error.message, error.code, error.param))


def _guarded(job: RenderJob, fn: Callable[[], T]) -> T | RequestError:
    """fn's result, or the error to answer the job with."""
    try:
        return fn()
    except RequestError as e:
        return e
    except (msgspec.ValidationError, msgspec.DecodeError) as e:  # the ingress validated it; be safe anyway
        return RequestError(400, str(e))
    except Exception:
        log.exception("render failed for %s", job.request_id)
        return RequestError(500, "internal error while rendering the request")
