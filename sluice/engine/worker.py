"""The engine process: one loop of receive (requests, aborts, the postproc's progress), step, emit."""
from __future__ import annotations

import ctypes
import sys
import time

import zmq

from sluice.base import metrics
from sluice.base.config import ServerConfig
from sluice.engine.engine import Engine
from sluice.engine.outputs import Outbox
from sluice.engine.scheduler import Scheduler, StepResult
from sluice.ipc.messages import EngineInput, StepsTaken, SupervisorInput
from sluice.ipc.stats import EngineStats
from sluice.ipc.transport import PullChannel, PushChannel

_IDLE_POLL_S = 0.25
_HELD_POLL_S = 0.01
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc mallopt parameters


def keep_heap_memory() -> None:
    """Keeps large tensors on the heap. glibc maps each allocation above 32 MiB afresh and unmaps it when
    freed, so a step's vocabulary-sized temporaries (batch-64 float32 logits are 51 MB) pay page faults on
    every step, which can cost more than the LM head itself (bench/RESULTS.md#decode-step-parts). Without
    mmap'd chunks (and with trimming only above 2 GiB free) those pages are reused. The engine is the one
    process with such temporaries; elsewhere, or without glibc, this does nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    libc.mallopt(_M_MMAP_MAX, 0)
    libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)


def run_engine(cfg: ServerConfig) -> None:
    keep_heap_memory()
    engine = Engine(cfg)
    ctx = zmq.Context()
    inbox: PullChannel[EngineInput] = PullChannel(ctx, cfg.addresses.engine, EngineInput)
    outbox = Outbox(ctx, cfg)
    gauges = Gauges(EngineStats(cfg.addresses.stats_path), engine.scheduler)
    PushChannel[SupervisorInput](ctx, cfg.addresses.supervisor).put(engine.ready())
    while True:
        receive(inbox, engine, outbox)
        t0 = time.perf_counter()
        result, samples = engine.step() if not outbox.full() else (StepResult(), None)
        step_time = time.perf_counter() - t0 if samples is not None else None
        ended = engine.take_ended()
        if samples is not None or ended:
            outbox.emit(result, samples, ended)
        gauges.update(step_time, len(result.new_tokens))


def receive(inbox: PullChannel[EngineInput], engine: Engine, outbox: Outbox) -> None:
    """Takes what came: without waiting while there is work and room to step; otherwise blocks, briefly
    while a request waits for its grammar or a shard to catch up."""
    if len(engine.scheduler) and not outbox.full():
        msgs = inbox.drain()
    else:
        first = inbox.get(timeout=_HELD_POLL_S if engine.held or len(engine.scheduler) else _IDLE_POLL_S)
        msgs = [first, *inbox.drain()] if first is not None else []
    for m in msgs:
        if isinstance(m, StepsTaken):
            outbox.taken(m)
        else:
            engine.accept(m)
    engine.admit_held()


class Gauges:
    """The engine's state as the supervisor and /metrics read it (sluice.ipc.stats), set after every turn of the
    loop; the finished requests' timings flushed in a batch (metrics.LATER)."""

    def __init__(self, stats: EngineStats, sched: Scheduler) -> None:
        self.stats, self.sched = stats, sched
        self.steps = self.tokens = 0
        self.step_time = self.step_seconds = 0.0
        stats.set(kv_total_blocks=sched.bm.num_blocks, alive=1)

    def update(self, step_time: float | None, tokens: int) -> None:
        if step_time is not None:
            self.steps += 1
            self.step_time = step_time
            self.step_seconds += step_time
        self.tokens += tokens
        sched, st = self.sched, self.sched.stats
        self.stats.set(heartbeat=time.time(), num_running=len(sched.running), num_waiting=len(sched.waiting),
                       kv_used_blocks=sched.bm.num_used, num_steps=self.steps, num_preemptions=st.num_preemptions,
                       generated_tokens=self.tokens, prefix_queries=st.prefix_queries, prefix_hits=st.prefix_hits,
                       step_time=self.step_time, step_seconds=self.step_seconds)
        now = time.monotonic()
        if not len(sched) or now - metrics.LATER.at >= metrics.FLUSH_S:
            metrics.LATER.flush(now)
