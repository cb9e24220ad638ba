"""Engine statistics in a small shared-memory block: written by the engine each
step, read by any ingress worker (health, metrics) without a round trip. Beside
it, the render and postproc workers' clocks: when each began its job, or was
last seen waiting for one (health)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import numpy as np

from sluice.ipc.shm import map_file

FIELDS = ("heartbeat", "num_running", "num_waiting", "kv_used_blocks", "kv_total_blocks", "num_steps",
          "num_preemptions", "generated_tokens", "alive", "prefix_queries", "prefix_hits", "step_time",
          "step_seconds")
_INDEX = {name: i for i, name in enumerate(FIELDS)}


class EngineStats:
    def __init__(self, path: str, *, create: bool = False) -> None:
        self._map = map_file(path, 8 * len(FIELDS), create=create)
        self._values = np.ndarray((len(FIELDS),), dtype=np.float64, buffer=self._map)

    def set(self, **values: float) -> None:
        for k, v in values.items():
            self._values[_INDEX[k]] = v

    def read(self) -> dict[str, float]:
        return dict(zip(FIELDS, self._values.tolist()))

    def close(self) -> None:
        del self._values  # (a view of the map: it must go before the map can close)
        self._map.close()


StageRole = Literal["render", "postproc"]
BEAT_S = 0.25  # a worker waiting for work says so this often (its clock may not lag behind more than this)


@dataclass(frozen=True)
class Stall:
    role: StageRole
    index: int
    seconds: float  # on its one job (or silent) this long


def stall_limits(stall_timeout: float, render_timeout: float, grammar_compile_timeout: float) -> dict[str, float]:
    """How long a worker of each role may be on one job before it counts as stuck. A postproc job (a few
    engine steps' tokens) takes milliseconds, so the engine's own stall timeout applies; a render may take its
    whole --render-timeout, and a grammar compile that began before it passed its own timeout too (the
    deadline does not cut a compile short), before the same stall timeout."""
    return {"render": render_timeout + grammar_compile_timeout + stall_timeout, "postproc": stall_timeout}


class StageClocks:
    """For each render and postproc worker, the time (time.time()) it began its current job, or was last seen
    waiting for one (every BEAT_S); 0 while it starts. One past its stall limit is stuck on a job, or stopped."""

    def __init__(self, path: str, render_workers: int, postproc_workers: int, *, create: bool = False) -> None:
        self._first = {"render": 0, "postproc": render_workers}
        self._count = {"render": render_workers, "postproc": postproc_workers}
        self._map = map_file(path, 8 * max(render_workers + postproc_workers, 1), create=create)
        self._values = np.ndarray((render_workers + postproc_workers,), dtype=np.float64, buffer=self._map)

    def beat(self, role: StageRole, index: int) -> None:
        self._values[self._first[role] + index] = time.time()

    def clear(self, role: StageRole, index: int) -> None:
        """Not watched until it beats: a worker that is (re)starting."""
        self._values[self._first[role] + index] = 0.0

    def stalled(self, limits: dict[str, float]) -> list[Stall]:
        now = time.time()
        out = []
        for role in ("render", "postproc"):
            for index in range(self._count[role]):
                since = float(self._values[self._first[role] + index])
                if since and now - since > limits[role]:
                    out.append(Stall(role, index, now - since))
        return out

    def close(self) -> None:
        del self._values
        self._map.close()
