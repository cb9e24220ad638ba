"""Render process: decode a job, run the chat core, send the engine request
(or the error straight back to the ingress worker)."""
from __future__ import annotations

import logging
import os
from collections import defaultdict
from pathlib import Path
from typing import Callable, TypeVar

import msgspec
import zmq

from ipc.messages import (EngineInput, Failure, Frame, Frames, IngressInput, Ready, Rendered, RenderInput, RenderJob,
                          SupervisorInput)
from ipc.transport import PullChannel, PushChannel, PushPool
from render.core import ChatCore
from render.errors import RequestError
from render.extensions import extension_for, options_of
from render.structured import GrammarCompiler, GrammarLimits
from render.tokenizer import load_tokenizer
from sluice import metrics
from sluice.config import ServerConfig

log = logging.getLogger("sluice.render")
T = TypeVar("T")


def build_core(cfg: ServerConfig) -> ChatCore:
    bundle = load_tokenizer(Path(cfg.model_path))
    hf = cfg.hf_config()
    return ChatCore(extension_for(hf, bundle, options_of(cfg)), bundle, max_model_len=cfg.max_model_len,
                    model_vocab_size=hf["vocab_size"], num_shards=cfg.postproc_workers,
                    grammars=GrammarCompiler(cfg.model_path, hf["vocab_size"], grammar_limits(cfg),
                                             cfg.grammar_backend),
                    perf_metrics=cfg.perf_metrics, stream_interval=cfg.stream_interval)


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
    PushChannel[SupervisorInput](ctx, addr.supervisor).put(Ready("render", index, os.getpid()))
    while True:
        backlog = [jobs.get(), *jobs.drain()]
        rendered: dict[str, list[str]] = defaultdict(list)  # ingress address -> requests now in the engine
        for i, job in enumerate(backlog):
            metrics.IN_FLIGHT.labels("render").set(len(backlog) - i)
            if job.count_only:
                replies.get(job.reply_to).put(Frames([_count_one(core, job)]))
                continue
            error = _render_one(core, job, engine)
            if error is None:
                rendered[job.reply_to].append(job.request_id)
            else:
                replies.get(job.reply_to).put(Frames([_failed(job, error)]))
        for address, rids in rendered.items():
            replies.get(address).put(Rendered(rids))
        metrics.IN_FLIGHT.labels("render").set(0)


def _render_one(core: ChatCore, job, engine) -> RequestError | None:
    """Renders one job and sends it to the engine; the error to answer with, if it cannot be served."""
    return _guarded(job, lambda: engine.put(core.render(job)))


def _count_one(core: ChatCore, job: RenderJob) -> Frame:
    """A count_only job's answer: its prompt's size, or why it cannot be rendered."""
    count = _guarded(job, lambda: core.count(job))
    if isinstance(count, RequestError):
        return _failed(job, count)
    return Frame(job.request_id, b'{"input_tokens":%d}' % count, done=True)


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
