"""Moving paged KV blocks between engines: the transports behind one seam.

A context engine whose KV leaves keeps its cache where a transport can read it (its `Exporter`); a
generation engine reads blocks into its own cache through an `Importer`. The default, `shm`, is one host:
the context engine's K and V tensors live in files on tmpfs, and the generation engine maps them and copies
block runs straight into its cache (no gather into a staging buffer). Across hosts, Mooncake's transfer
engine reads the same registered tensors (engine/kv_mooncake.py).

A lease table in shared memory guards every read: slot k holds a lease's tag while the context engine keeps
its blocks, and is cleared before they are freed. A reader checks the tag before and after copying; a lease
that ended in between (expired, the context engine gone) makes the read fail instead of handing over blocks
that may have been reused.
"""
from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from typing import Callable, Protocol, TextIO

import numpy as np
import torch

from sluice.ipc.kv import KvHandle, KvLayout
from sluice.ipc.shm import map_file, shm_base

LEASE_SLOTS = 1 << 14


class KvReadError(Exception):
    """The blocks could not be read: the lease ended, the peer is gone, or the handle does not fit here."""


@dataclass(frozen=True)
class BlockCopy:
    """Copy source blocks `src[i]` of a peer's pool into local blocks `dst[i]`."""

    pool: str  # "block_table" or "window_table"
    src: list[int]
    dst: list[int]


def layout_of(runner) -> KvLayout | None:
    """The runner's KV layout (None: a runner that keeps no KV, the replay runner)."""
    caches = getattr(runner, "kv_caches", None)
    if not caches:
        return None
    _, heads, dim = caches[0][0].shape
    pools = tuple(runner.tables[w] for w in runner.model.layer_windows)
    return KvLayout(runner.block_size, str(caches[0][0].dtype).removeprefix("torch."), pools, heads, dim)


def cache_tensors(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
    """(layer, tensor) of each cache tensor, in the order the context engine allocated them: K then V of each
    layer, or the one tensor of a latent cache (multi-head latent attention: K and V are one tensor)."""
    return [(layer, t) for layer, (k, v) in enumerate(caches) for t in ((k,) if v is k else (k, v))]


def log_transfer(timing: TextIO | None, request_id: str, side: str, backend: str | None, start: float, end: float,
                 moved: int, blocks: int, outcome: str) -> None:
    """One --kv-timing-output line for a KV transfer, on the side that sent it (its lease's life) or read it.
    `start`/`end` are TensorRT-LLM's kv_cache_transfer_start/_end, `bytes` its kv_cache_size (its rank's
    send/recv files under TRTLLM_KVCACHE_TIME_OUTPUT_PATH split the sides as `side` does)."""
    if timing is not None:
        timing.write(json.dumps({"request_id": request_id, "kv_transfer": {
            "side": side, "backend": backend, "start": start, "end": end, "bytes": moved, "blocks": blocks,
            "outcome": outcome}}) + "\n")


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs where both sides' block ids go up by one together."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


# ---- the lease table ------------------------------------------------------------------------------------------

class LeaseTable:
    """Slots of 64-bit tags in a shared-memory file: nonzero while a lease lives."""

    def __init__(self, path: str, *, create: bool, slots: int = LEASE_SLOTS) -> None:
        self.path = path
        self._map = map_file(path, 8 * slots, create=create)
        self.tags = np.ndarray((slots,), dtype=np.uint64, buffer=self._map)
        self._free = list(range(slots - 1, -1, -1)) if create else []

    def take(self, tag: int) -> int | None:
        """A free slot, now holding `tag` (None: every slot is taken)."""
        if not self._free:
            return None
        slot = self._free.pop()
        self.tags[slot] = tag
        return slot

    def clear(self, slot: int) -> None:
        self.tags[slot] = 0
        self._free.append(slot)

    def holds(self, slot: int, tag: int) -> bool:
        return 0 <= slot < len(self.tags) and int(self.tags[slot]) == tag

    def close(self) -> None:
        del self.tags
        self._map.close()


# ---- the seam -------------------------------------------------------------------------------------------------

class Exporter(Protocol):
    """The context side of a transport: where its cache is, for the handles it gives out."""

    name: str
    leases: LeaseTable

    def location(self) -> dict[str, str]: ...

    def close(self) -> None: ...


class Importer(Protocol):
    """The generation side: copies a peer's blocks into this engine's cache."""

    def read(self, handle: KvHandle, copies: list[BlockCopy]) -> int:
        """Copies the blocks (raises KvReadError); returns the bytes moved."""
        ...


Alloc = Callable[[tuple[int, ...]], torch.Tensor]


# ---- shared memory (one host) ---------------------------------------------------------------------------------

class ShmExporter:
    """The context engine's K and V tensors, one tmpfs file each, and its lease table."""

    name = "shm"

    def __init__(self, directory: str, dtype: torch.dtype, device: torch.device) -> None:
        if device.type != "cpu":
            raise SystemExit("--kv-transfer shm keeps the KV cache in host shared memory: it needs --device cpu "
                             "(use --kv-transfer mooncake on a GPU)")
        self.directory = directory
        self.dtype = dtype
        self.files: list[str] = []
        self._maps: list[mmap.mmap] = []
        self.leases = LeaseTable(os.path.join(directory, "kv-leases"), create=True)

    def alloc(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zeroed cache tensor in a file of its own (tmpfs pages start zeroed)."""
        path = os.path.join(self.directory, f"kv-{len(self.files)}")
        size = int(np.prod(shape)) * torch.empty((), dtype=self.dtype).element_size()
        m = map_file(path, max(size, 1), create=True)
        self.files.append(path)
        self._maps.append(m)
        return torch.frombuffer(m, dtype=self.dtype, count=int(np.prod(shape))).view(shape)

    def location(self) -> dict[str, str]:
        return {"files": "\n".join(self.files), "leases": self.leases.path}

    def close(self) -> None:
        self.leases.close()


class _Peer:
    """A context engine's cache files, mapped read-only."""

    def __init__(self, handle: KvHandle) -> None:
        paths = [handle.location["leases"], *(handle.location["files"].split("\n") if handle.location.get("files")
                                              else [])]
        if any(not os.path.realpath(p).startswith(os.path.join(shm_base(), "sluice-")) for p in paths):
            raise ValueError("the handle names files outside a Sluice server's shared memory")
        self.leases_path = handle.location["leases"]
        self.inode = os.stat(self.leases_path).st_ino
        self.leases = LeaseTable(self.leases_path, create=False)
        self.tensors: list[np.ndarray] = []
        for path in handle.location["files"].split("\n") if handle.location.get("files") else []:
            with open(path, "rb") as f:
                # populated now: a read then never waits on page faults (the peer's cache, mapped once)
                m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                              prot=mmap.PROT_READ)
            self.tensors.append(np.frombuffer(m, dtype=np.uint8))

    def alive(self) -> bool:
        try:
            return os.stat(self.leases_path).st_ino == self.inode
        except FileNotFoundError:
            return False


class ShmImporter:
    """Reads peers' blocks from their tmpfs files into this engine's cache (`caches`: the runner's (K, V) per
    layer). Peers stay mapped while their files live (a bounded number of them)."""

    MAX_PEERS = 32

    def __init__(self, caches: list[tuple[torch.Tensor, torch.Tensor]], layout: KvLayout | None) -> None:
        self.caches = caches
        self.layout = layout
        self._peers: dict[str, _Peer] = {}

    def _peer(self, handle: KvHandle) -> _Peer:
        key = handle.location.get("leases", "")
        for gone in [k for k, p in self._peers.items() if not p.alive()]:  # unmapped: their memory goes back
            del self._peers[gone]
        peer = self._peers.get(key)
        if peer is None:
            try:
                peer = _Peer(handle)
            except (OSError, KeyError, ValueError) as e:
                raise KvReadError(f"the context worker's KV cache cannot be opened: {e}") from None
            if len(self._peers) >= self.MAX_PEERS:
                self._peers.pop(next(iter(self._peers)))
            self._peers[key] = peer
        return peer

    def read(self, handle: KvHandle, copies: list[BlockCopy]) -> int:
        if handle.layout != self.layout:
            raise KvReadError(f"the context worker's KV layout {handle.layout} is not this one's {self.layout}")
        peer = self._peer(handle)
        if not peer.leases.holds(handle.lease_slot, handle.lease_tag):
            raise KvReadError("the context worker's lease on these blocks has ended")
        moved = 0
        if self.layout is not None:
            if len(peer.tensors) != len(cache_tensors(self.caches)):
                raise KvReadError("the context worker's KV files do not match this model")
            moved = self._copy(peer, copies)
        if not peer.leases.holds(handle.lease_slot, handle.lease_tag):  # ended while copying: the copy may be torn
            raise KvReadError("the context worker's lease ended while its blocks were read")
        return moved

    def _copy(self, peer: _Peer, copies: list[BlockCopy]) -> int:
        assert self.layout is not None
        moved = 0
        for src, (layer, dst) in zip(peer.tensors, cache_tensors(self.caches)):
            pool = self.layout.pools[layer]
            width = self.layout.block_elements * dst.element_size()  # bytes of one block of this tensor
            dst_bytes = dst.view(-1).view(torch.uint8).numpy()  # this engine's cache, as bytes
            for c in copies:
                if c.pool != pool:
                    continue
                for s, d, n in runs(c.src, c.dst):
                    dst_bytes[d * width:(d + n) * width] = src[s * width:(s + n) * width]
                    moved += n * width
        return moved
