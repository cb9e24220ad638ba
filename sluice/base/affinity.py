"""Where the engine and the postproc workers run (--cpu-affinity).

The engine sends each postproc worker a message every step and waits for its answer when it is
--max-steps-ahead steps ahead. Where the stage processes outnumber the cores, the kernel keeps moving
them between cores, and each of those messages (four threads: two ZeroMQ I/O threads and the two
stages) then hops between cores. On one core together, the exchange stays there: on 2 cores the replay
pipeline streams more tokens (bench/JOURNAL.md, 2026-12-02 fifth session), and pinning only
their main threads, or their I/O threads elsewhere, is worse than pinning every thread; as SCHED_BATCH
there (see pin) more again. An engine that computes on the CPU needs every core for its kernels,
so it is left where it is.
"""
from __future__ import annotations

import os


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its cpuset, not the machine's count)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def parse_cpus(spec: str) -> set[int]:
    """`2-3,6` -> {2, 3, 6}."""
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def listed_cpus(spec: str) -> set[int] | None:
    """The CPUs a --cpu-affinity list names (None for auto and off); SystemExit for any this process may not
    use (checked at startup, before anything starts)."""
    if spec in ("auto", "off"):
        return None
    cpus, allowed = parse_cpus(spec), allowed_cpus()
    if not cpus <= set(allowed):
        raise SystemExit(f"sluice: --cpu-affinity {spec}: this process may run on CPUs {allowed} only")
    return cpus


def token_path_cpus(spec: str, busy_stages: int, cpu_compute: bool) -> set[int] | None:
    """The CPUs for the engine and the postproc workers, or None to leave them anywhere. `busy_stages`: the
    stage processes that work under load (engine, render, postproc, ingress workers)."""
    if spec != "auto":
        return listed_cpus(spec)
    allowed = allowed_cpus()
    if cpu_compute or busy_stages <= len(allowed):
        return None
    return {allowed[-1]}


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` on `cpus` (threads it starts later inherit it from the thread starting
    them); on a single core, as SCHED_BATCH: a message from the other stage there then does not preempt the
    one running (each finishes what it has), while the HTTP side's wake-ups still do. A thread or process
    that ended meanwhile is skipped."""
    if not hasattr(os, "sched_setaffinity"):  # not Linux
        return
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
            if len(cpus) == 1:
                os.sched_setscheduler(int(tid), os.SCHED_BATCH, os.sched_param(0))
        except OSError:
            pass
