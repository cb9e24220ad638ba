"""--kv-transfer mooncake: Mooncake's transfer engine in its TCP mode, peer to peer (no metadata service).

The context engine registers each K and V tensor of its cache (and its lease table) with its transfer
engine; a handle names the engine (host:port) and the tensors' addresses. The generation engine registers
its own cache and reads block runs straight into it, checking the lease tag before and after, as the shm
transport does (bench/kv_transfer.py compares them). Install: `pip install mooncake-transfer-engine-non-cuda`
and Debian's `libibverbs1` (the wheel links it even for TCP).
"""
from __future__ import annotations

import os

import numpy as np
import torch

from sluice.base.config import ServerConfig
from sluice.engine.kv_transfer import BlockCopy, KvReadError, LeaseTable, cache_tensors, runs
from sluice.ipc.kv import KvHandle, KvLayout


def _engine(cfg: ServerConfig):
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise SystemExit(f"--kv-transfer mooncake: the transfer engine does not load ({e}); install "
                         "mooncake-transfer-engine-non-cuda (pip) and libibverbs1 (apt)") from None
    engine = TransferEngine()
    host = cfg.advertise_host or cfg.host
    if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit(f"--kv-transfer mooncake: the transfer engine did not start on {host}")
    return engine, f"{host}:{engine.get_rpc_port()}"


class MooncakeExporter:
    name = "mooncake"

    def __init__(self, cfg: ServerConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.engine, self.peer = _engine(cfg)
        self.dtype, self.device = dtype, device
        self.tensors: list[torch.Tensor] = []
        self.leases = LeaseTable(os.path.join(cfg.addresses.shm_dir, "kv-leases"), create=True)
        self._register(self.leases.tags.ctypes.data, self.leases.tags.nbytes)

    def _register(self, addr: int, size: int) -> None:
        if self.engine.register_memory(addr, size) != 0:
            raise SystemExit("--kv-transfer mooncake: registering the KV cache failed")

    def alloc(self, shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._register(t.data_ptr(), t.numel() * t.element_size())
        self.tensors.append(t)
        return t

    def location(self) -> dict[str, str]:
        return {"peer": self.peer, "tensors": ",".join(str(t.data_ptr()) for t in self.tensors),
                "leases": str(self.leases.tags.ctypes.data)}

    def close(self) -> None:
        self.leases.close()


class MooncakeImporter:
    def __init__(self, cfg: ServerConfig, caches: list[tuple[torch.Tensor, torch.Tensor]],
                 layout: KvLayout | None) -> None:
        self.engine, _ = _engine(cfg)
        self.caches = caches
        self.layout = layout
        self.tag = np.zeros(1, dtype=np.uint64)  # where a lease's tag is read to
        for addr, size in [(self.tag.ctypes.data, 8)] + [(t.data_ptr(), t.numel() * t.element_size())
                                                         for _, t in cache_tensors(caches)]:
            self.engine.register_memory(addr, size)

    def _holds(self, handle: KvHandle) -> bool:
        remote = int(handle.location["leases"]) + 8 * handle.lease_slot
        if self.engine.transfer_sync_read(handle.location["peer"], self.tag.ctypes.data, remote, 8) != 0:
            raise KvReadError(f"the context worker at {handle.location['peer']} does not answer")
        return int(self.tag[0]) == handle.lease_tag

    def read(self, handle: KvHandle, copies: list[BlockCopy]) -> int:
        if handle.layout != self.layout or handle.backend != "mooncake":
            raise KvReadError(f"the context worker's KV layout {handle.layout} is not this one's {self.layout}")
        if not self._holds(handle):
            raise KvReadError("the context worker's lease on these blocks has ended")
        if self.layout is None:
            return 0
        remote = [int(a) for a in handle.location["tensors"].split(",")]
        tensors = cache_tensors(self.caches)
        if len(remote) != len(tensors):
            raise KvReadError("the context worker's KV tensors do not match this model")
        local_addrs, remote_addrs, lengths = [], [], []
        for peer_addr, (layer, dst) in zip(remote, tensors):
            width = self.layout.block_elements * dst.element_size()
            for c in copies:
                if c.pool != self.layout.pools[layer]:
                    continue
                for s, d, n in runs(c.src, c.dst):
                    local_addrs.append(dst.data_ptr() + d * width)
                    remote_addrs.append(peer_addr + s * width)
                    lengths.append(n * width)
        if local_addrs and self.engine.batch_transfer_sync_read(handle.location["peer"], local_addrs, remote_addrs,
                                                                lengths) != 0:
            raise KvReadError(f"reading the blocks from {handle.location['peer']} failed")
        if not self._holds(handle):
            raise KvReadError("the context worker's lease ended while its blocks were read")
        return sum(lengths)
