"""/health and /ready watch the render and postproc workers as they watch the engine (issue 37): one on a job
past its stall limit is named, one that beats is not, and a postproc worker gets the engine's stall timeout
while a render worker also gets its --render-timeout and --grammar-compile-timeout. (The render stall end to
end: tests/e2e/test_render_limits.py.)"""
from __future__ import annotations

import time

import pytest

from sluice.base.config import ServerConfig
from sluice.ingress.pipeline import Pipeline
from sluice.ipc.stats import EngineStats, StageClocks, stall_limits


@pytest.fixture
def pipeline(tmp_path):
    """A pipeline's health view (no sockets): a live engine, two render and two postproc workers."""
    p = object.__new__(Pipeline)
    p.cfg = ServerConfig(model="m", served_model_names=["m"], stall_timeout=10, render_timeout=30,
                         grammar_compile_timeout=20, render_workers=2, postproc_workers=2)
    p.engine_dead = False
    p.stats = EngineStats(str(tmp_path / "stats"), create=True)
    p.stats.set(alive=1, heartbeat=time.time())
    p.clocks = StageClocks(str(tmp_path / "clocks"), 2, 2, create=True)
    p._stall_limits = stall_limits(p.cfg.stall_timeout, p.cfg.render_timeout, p.cfg.grammar_compile_timeout)
    yield p
    p.stats.close()
    p.clocks.close()


def _began(clocks: StageClocks, role, index: int, seconds_ago: float) -> None:
    clocks._values[clocks._first[role] + index] = time.time() - seconds_ago


def test_every_worker_beating_is_healthy_and_a_starting_one_is_not_watched(pipeline):
    for role in ("render", "postproc"):
        pipeline.clocks.beat(role, 0)
    assert pipeline.health_problem() is None  # (index 1 of each: 0, starting)


def test_a_postproc_worker_on_one_job_past_the_stall_timeout_is_named(pipeline):
    _began(pipeline.clocks, "postproc", 1, 9)
    assert pipeline.health_problem() is None
    _began(pipeline.clocks, "postproc", 1, 11)
    assert pipeline.health_problem() == "postproc worker 1 is stuck: on one job (or silent) for 11s"


def test_a_render_worker_has_its_render_and_compile_timeouts_before_the_stall_timeout(pipeline):
    _began(pipeline.clocks, "render", 0, 59)  # (30 + 20 + 10: not yet)
    assert pipeline.health_problem() is None
    _began(pipeline.clocks, "render", 0, 61)
    assert pipeline.health_problem() == "render worker 0 is stuck: on one job (or silent) for 61s"


def test_a_dead_engine_comes_first(pipeline):
    _began(pipeline.clocks, "postproc", 0, 100)
    pipeline.engine_dead = True
    assert pipeline.health_problem() == "engine unavailable"
