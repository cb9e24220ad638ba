"""--cpu-affinity: the engine and the postproc workers on the CPUs it names (or that auto picks), every thread
of them, a restarted postproc worker too; an engine that computes on the CPU left on every core."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from bench.server import Server
from sluice.base import affinity


def test_parse_cpus():
    assert affinity.parse_cpus("3") == {3}
    assert affinity.parse_cpus("0-2,5,7-8") == {0, 1, 2, 5, 7, 8}


@pytest.mark.parametrize("cores, busy, cpu_compute, spec, want", [
    ([0, 1], 4, False, "auto", {1}),  # outnumbered: the last core
    ([0, 1, 2, 3], 4, False, "auto", None),  # a core each: nothing to gain
    ([0, 1], 4, True, "auto", None),  # the engine's kernels need every core
    ([4, 6], 4, False, "auto", {6}),  # the cores this process may use, not their count
    ([0, 1], 4, True, "0", {0}),  # as told
    ([0, 1], 4, False, "off", None),
])
def test_which_cpus(monkeypatch, cores, busy, cpu_compute, spec, want):
    monkeypatch.setattr(affinity, "allowed_cpus", lambda: cores)
    assert affinity.token_path_cpus(spec, busy, cpu_compute) == want


def test_cpus_this_process_may_not_use_are_refused(monkeypatch):
    monkeypatch.setattr(affinity, "allowed_cpus", lambda: [0, 1])
    with pytest.raises(SystemExit, match="CPUs \\[0, 1\\] only"):
        affinity.token_path_cpus("1-2", 4, False)


def _cpus(pid: int) -> set[frozenset[int]]:
    """The CPU sets of a process's threads."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


def _policies(pid: int) -> set[int]:
    return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def _pid(server: Server, role: str, nth: int = 0) -> int:
    return int(re.findall(rf"{role}\[0\] ready \(pid (\d+)\)", server.output())[nth])


def test_engine_and_postproc_run_where_they_are_told_a_restarted_postproc_too():
    allowed = affinity.allowed_cpus()
    last = allowed[-1]
    s = Server("--runner", "replay", "--cpu-affinity", str(last))
    try:
        for role in ("engine", "postproc"):  # on one core: SCHED_BATCH (they do not preempt each other)
            assert _cpus(_pid(s, role)) == {frozenset({last})} and _policies(_pid(s, role)) == {os.SCHED_BATCH}, role
        assert _cpus(_pid(s, "render")) == {frozenset(allowed)}  # the other stages run anywhere, as before
        assert _policies(_pid(s, "render")) == {os.SCHED_OTHER}
        os.kill(_pid(s, "postproc"), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while len(re.findall(r"postproc\[0\] ready", s.output())) < 2:
            assert time.monotonic() < deadline, s.output()
            time.sleep(0.1)
        assert _cpus(_pid(s, "postproc", 1)) == {frozenset({last})}
        assert _policies(_pid(s, "postproc", 1)) == {os.SCHED_BATCH}
    finally:
        s.stop()


def test_auto_pins_a_replay_engine_where_the_stages_outnumber_the_cores():
    s = Server("--runner", "replay", "--postproc-workers", "1", "--render-workers", "1", "--ingress-workers", "1")
    try:
        want = affinity.token_path_cpus("auto", 4, False) or set(affinity.allowed_cpus())
        for role in ("engine", "postproc"):
            assert _cpus(_pid(s, role)) == {frozenset(want)}, role
    finally:
        s.stop()


def test_an_engine_computing_on_the_cpu_keeps_every_core(server):
    assert _cpus(server.stage_pid("engine")) == {frozenset(affinity.allowed_cpus())}


def test_a_cpu_the_server_may_not_use_is_refused_before_anything_starts():
    cpu = max(affinity.allowed_cpus()) + 1
    done = subprocess.run([sys.executable, "-m", "sluice", "serve", "--runner", "replay", "--cpu-affinity",
                           str(cpu), "--port", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and f"--cpu-affinity {cpu}: this process may run on CPUs" in done.stderr
