"""Every socket address of one server, derived from its runtime directory."""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

from sluice.ipc.shm import shm_base


@dataclass(frozen=True)
class Addresses:
    runtime_dir: str

    def _ipc(self, name: str) -> str:
        return f"ipc://{os.path.join(self.runtime_dir, name)}"

    @property
    def engine(self) -> str:
        return self._ipc("sluice.engine.sock")

    @property
    def supervisor(self) -> str:
        return self._ipc("supervisor.sock")

    @property
    def control(self) -> str:
        return self._ipc("control.sock")

    def render(self, index: int) -> str:
        return self._ipc(f"render-{index}.sock")

    def postproc(self, index: int) -> str:
        return self._ipc(f"postproc-{index}.sock")

    def ingress(self, pid: int) -> str:
        return self._ipc(f"ingress-{pid}.sock")

    @property
    def shm_dir(self) -> str:
        """tmpfs directory for this server's shared-memory files."""
        return os.path.join(shm_base(), os.path.basename(self.runtime_dir.rstrip("/")))

    @property
    def stats_path(self) -> str:
        return os.path.join(self.shm_dir, "engine-stats")

    @property
    def stage_clocks_path(self) -> str:
        return os.path.join(self.shm_dir, "stage-clocks")


def shard_of(request_id: str, num_shards: int) -> int:
    """The postproc shard that owns a request: stable across processes."""
    return zlib.crc32(request_id.encode()) % num_shards
