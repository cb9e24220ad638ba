"""A render's deadline (--render-timeout) and its client's leaving, enforced inside the render worker.

A render is CPU work on the worker's one thread, and nothing outside it can stop it there. So while a job
renders, a CPU-time timer (SIGPROF every TICK_S of the process's CPU) runs a handler that asks for new
messages (an abort of this job) and, once the deadline has passed or the job was aborted, raises
RenderStopped where the render is: the worker answers and takes its next job. The timer counts CPU time, so
it wakes only while the worker computes, which is when there is something to stop; and it is not SIGALRM,
which the chat template's own time limit (render/chat_template.py) and pytest-timeout use.

An exception raised at any bytecode could leave state half changed. So the handler raises only where the
code is `interruptible()` (the render as a whole), never where it is `shielded()` (bookkeeping that must
finish: the template's alarm set and reset, a grammar compile's exchange with its child process); a shield
that closes past the deadline raises as it closes. It raises once a job.
"""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Literal

TICK_S = 0.05  # of the process's CPU time: how late past its deadline a render stops, at most

StopReason = Literal["timeout", "aborted"]


class RenderStopped(BaseException):
    """Raised in a render past its deadline or aborted: a BaseException, so that no `except Exception` on the
    way (a template's, a translator's) takes it for the request's own failure."""

    def __init__(self, reason: StopReason) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Job:
    request_id: str
    deadline: float  # time.monotonic()
    poll: Callable[[], None]  # takes in what came for the worker meanwhile (an abort calls abort())
    stop: StopReason | None = None
    raised: bool = False
    polling: bool = False


_job: _Job | None = None
_regions: list[bool] = []  # innermost last: whether the handler may raise there


def _tick(signum, frame) -> None:
    job = _job
    if job is None or job.raised or job.polling:
        return
    if _due(job) is None:
        job.polling = True
        try:
            job.poll()
        finally:
            job.polling = False
    _raise_if_due(job)


def _due(job: _Job) -> StopReason | None:
    if job.stop is None and time.monotonic() >= job.deadline:
        job.stop = "timeout"
    return job.stop


def _raise_if_due(job: _Job) -> None:
    if (stop := _due(job)) is not None and not job.raised and _regions and _regions[-1]:
        job.raised = True
        raise RenderStopped(stop)


class watched:
    """Runs the body as `request_id`'s render: RenderStopped comes out of it once `seconds` have passed, or
    once abort(request_id) was called (by `poll`, from the handler, or by the body itself). (A class, as the
    regions below: entered once a render, where a generator's context manager costs several times more.)"""

    __slots__ = ("_job", "_depth")

    def __init__(self, request_id: str, seconds: float, poll: Callable[[], None]) -> None:
        self._job = _Job(request_id, time.monotonic() + seconds, poll)
        self._depth: int | None = None

    def __enter__(self) -> None:
        global _job
        if threading.current_thread() is not threading.main_thread():  # (signals reach the main thread only)
            return
        if signal.getsignal(signal.SIGPROF) is not _tick:  # (kept once set: a signal already on its way finds it)
            signal.signal(signal.SIGPROF, _tick)
        self._depth = len(_regions)
        _regions.extend((False, True))  # the job's own level, then the render: interruptible
        _job = self._job
        signal.setitimer(signal.ITIMER_PROF, TICK_S, TICK_S)

    def __exit__(self, *exc) -> None:
        global _job
        if self._depth is None:
            return
        signal.setitimer(signal.ITIMER_PROF, 0)
        _job = None
        del _regions[self._depth:]


def abort(request_id: str) -> None:
    """The request's client left: its render, if it is the one running, stops at the next tick."""
    if _job is not None and _job.request_id == request_id and _job.stop is None:
        _job.stop = "aborted"


class _Region:
    """A stretch of code where the handler may raise (interruptible) or may not (shielded)."""

    __slots__ = ("_may_raise", "_depth")

    def __init__(self, may_raise: bool) -> None:
        self._may_raise = may_raise

    def __enter__(self) -> None:
        self._depth = len(_regions)
        _regions.append(self._may_raise)

    def __exit__(self, exc_type, *exc) -> None:
        del _regions[self._depth:]
        if not self._may_raise and exc_type is None and _job is not None:
            _raise_if_due(_job)  # a deadline that passed in a shielded stretch stops the render after it


class excused:
    """The server's own one-time work on a render's way (starting the grammar compiler, loading its
    vocabulary): its time is added to the job's deadline, so no request is charged for the server's warm-up.
    Used inside a shielded stretch (nothing raises in it)."""

    __slots__ = ("_t0",)

    def __enter__(self) -> None:
        self._t0 = time.monotonic()

    def __exit__(self, *exc) -> None:
        job = _job
        if job is not None:
            job.deadline += time.monotonic() - self._t0
            if job.stop == "timeout" and not job.raised and time.monotonic() < job.deadline:
                job.stop = None  # (a tick meanwhile saw the deadline it had before)


def interruptible() -> _Region:
    return _Region(True)


def shielded() -> _Region:
    """The body runs to its end whatever the deadline; one that passed meanwhile stops the render after it
    (only on a normal exit: an exception on its way goes on as it is)."""
    return _Region(False)
