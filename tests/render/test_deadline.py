"""A render's deadline (--render-timeout) and its client's leaving, inside the render worker (issue 37): the
render stops where it is, the worker answers and takes its next job, and nothing of the stopped render is
left behind (the chat template's alarm, a grammar compile's exchange)."""
from __future__ import annotations

import json
import signal
import time
from collections import deque

import msgspec
import pytest

from sluice.base.config import ServerConfig
from sluice.ipc.messages import Abort, EngineRequest, Frame, RenderJob
from sluice.render import deadline
from sluice.render.worker import RenderWorker, build_core

# A template that runs for hours (the chat template's own limit, 5 s, is not what stops it here).
FOREVER = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def core(tiny_chat_dir):
    return build_core(ServerConfig(model="m", model_path=str(tiny_chat_dir), served_model_names=["m"],
                                   runtime_dir="/tmp/x", max_model_len=256, postproc_workers=1,
                                   trust_request_chat_template=True))


def job(rid: str, **fields) -> RenderJob:
    return RenderJob(rid, "chat", json.dumps({"model": "m", "messages": HI, **fields}).encode(), "ipc://x", 0.0)


def busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


class Jobs:
    """A render worker's job channel: messages there now, and messages that come once `after` seconds pass."""

    def __init__(self, now: list, later: list | None = None, after: float = 0.0) -> None:
        self.now, self.later, self.at = deque(now), list(later or []), time.monotonic() + after

    def get(self, timeout: float):
        return self.now.popleft() if self.now else None

    def drain(self) -> list:
        if self.later and time.monotonic() >= self.at:
            self.now.extend(self.later)
            self.later = []
        out = list(self.now)
        self.now.clear()
        return out


def test_a_render_past_its_deadline_stops_where_it_is():
    with pytest.raises(deadline.RenderStopped) as e:  # (not stopped, the work would end without a raise)
        with deadline.watched("r1", 0.2, lambda: None):
            busy(30)
    assert e.value.reason == "timeout"
    assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)  # no tick left running between jobs


def test_a_shielded_step_runs_to_its_end_and_the_render_stops_after_it():
    steps = []
    with pytest.raises(deadline.RenderStopped):
        with deadline.watched("r1", 0.1, lambda: None):
            with deadline.shielded():
                busy(0.4)
                steps.append("shielded")
            steps.append("after")
    assert steps == ["shielded"]


def test_the_servers_own_warm_up_is_not_charged_to_the_render():
    """A grammar compiler started on a request's way (render/structured.py) is the server's one-time cost: the
    time spent in `excused` moves the deadline, so the render's own work still has its whole allowance."""
    steps = []
    with deadline.watched("r1", 0.3, lambda: None):
        with deadline.shielded(), deadline.excused():
            busy(0.5)
        busy(0.2)
        steps.append("done")
    assert steps == ["done"]
    with pytest.raises(deadline.RenderStopped):  # (without the excuse the same work is past its deadline)
        with deadline.watched("r2", 0.3, lambda: None):
            with deadline.shielded():
                busy(0.5)
            busy(0.2)


def test_an_abort_stops_the_render_it_names_and_no_other():
    with pytest.raises(deadline.RenderStopped) as e:
        with deadline.watched("r1", 30, lambda: deadline.abort("r1")):
            busy(30)
    assert e.value.reason == "aborted"
    with pytest.raises(deadline.RenderStopped) as e:
        with deadline.watched("r2", 0.3, lambda: deadline.abort("r1")):
            busy(30)
    assert e.value.reason == "timeout"


def test_a_render_past_render_timeout_is_a_408_and_the_worker_takes_the_next_job(core):
    worker = RenderWorker(core, Jobs([job("slow", chat_template=FOREVER), job("next")]), timeout=0.3)
    alarm, (timer, _) = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)
    assert worker.wait(0)
    slow, following = worker.batch()
    answer = worker.render(slow)  # (the 408 says the deadline stopped it: the template's own limit is a 400)
    assert isinstance(answer, Frame) and answer.done and answer.error.status == 408
    assert answer.error.code == "render_timeout" and "--render-timeout (0.3s)" in answer.error.message
    # the chat template's own alarm (stopped inside it) is put back as it was: pytest-timeout's, if it runs one
    assert signal.getsignal(signal.SIGALRM) == alarm
    assert (signal.getitimer(signal.ITIMER_REAL)[0] > 0) == (timer > 0)
    worker.timeout = 30  # (the next job's own 0.3 s could pass on loaded cores; a stop left over would not wait)
    assert isinstance(worker.render(following), EngineRequest)


def test_an_abort_stops_the_render_running_and_drops_the_job_waiting(core):
    jobs = Jobs([job("left", chat_template=FOREVER), job("gone-too"), job("stays")],
                later=[Abort(["left", "gone-too"])], after=0.2)
    worker = RenderWorker(core, jobs, timeout=30)
    assert worker.wait(0)
    answers = {}
    for j in worker.batch():  # (the 499 says the abort stopped it: its deadline, 30 s, would be a 408)
        answers[j.request_id] = worker.render(j)
    assert list(answers) == ["left", "stays"]
    assert answers["left"].error.status == 499 and isinstance(answers["stays"], EngineRequest)


def test_a_count_past_render_timeout_is_a_408_too(core):
    worker = RenderWorker(core, Jobs([]), timeout=0.3)
    answer = worker.answer(msgspec.structs.replace(job("slow", chat_template=FOREVER), answer="count"))
    assert answer.error.status == 408 and answer.error.code == "render_timeout"
