"""Engine statistics in a small shared-memory block: written by the engine each
step, read by any ingress worker (health, metrics) without a round trip."""
from __future__ import annotations

import numpy as np

from ipc.shm import map_file

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
