"""ps, top and py-spy tell a server's processes apart: each names its stage, not `python -c from
multiprocessing.spawn import spawn_main ...`; and its environment still shows in /proc/<pid>/environ."""
from __future__ import annotations

import time
from collections import Counter

import pytest

from bench.procs import descendants, environ, title
from bench.server import Server
from sluice.base import procs

pytestmark = pytest.mark.skipif(not procs.titles_supported(), reason="setproctitle is not installed")


def _titles(server: Server, expected: Counter, timeout: float = 60) -> dict[int, str]:
    """pid -> title once every expected title shows (granian starts its workers one by one)."""
    deadline = time.monotonic() + timeout
    while True:
        titles = {pid: title(pid) for pid in descendants(server.proc.pid)}
        if not expected - Counter(titles.values()) or time.monotonic() > deadline:
            return titles
        time.sleep(0.1)


def test_every_process_of_a_server_shows_its_stage_in_ps():
    server = Server("--ingress-workers", "2", "--render-workers", "2", "--postproc-workers", "2")
    try:
        expected = Counter({"sluice: engine": 1, "sluice: render 0": 1, "sluice: render 1": 1,
                            "sluice: postproc 0": 1, "sluice: postproc 1": 1, "sluice: granian": 1,
                            "sluice: ingress": 2})
        titles = _titles(server, expected)
        assert not expected - Counter(titles.values()), titles
        assert title(server.proc.pid) == "sluice: supervisor"
        assert not [t for t in titles.values() if "multiprocessing.spawn" in t], titles
        named = [pid for pid, t in titles.items() if t in expected]
        assert all("PROMETHEUS_MULTIPROC_DIR" in environ(pid) for pid in named), titles
    finally:
        assert server.stop() == 0, server.output()
