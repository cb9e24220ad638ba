"""Shared memory as mmapped files in a per-server directory on tmpfs.

Files, not multiprocessing.shared_memory: no resource tracker to disagree
between processes, and the supervisor removes the whole directory at exit,
whatever became of the processes that made them.

`ShmRing*` is a single-producer, single-consumer ring for bulk payloads: the
producer copies a payload in and sends only a small descriptor over ZeroMQ;
the consumer copies it out and advances the read cursor kept in the header.
A ring never blocks: when it is full the producer sends the payload inline.
"""
from __future__ import annotations

import mmap
import os
import secrets

import numpy as np

_HEADER = 64  # bytes; [0:8] is the consumer's read cursor (uint64)


def shm_base() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


def map_file(path: str, size: int, *, create: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        # Populate the page tables now, not with a fault per page on the hot path.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(fd, size, flags=flags)
    finally:
        os.close(fd)


class ShmRingWriter:
    def __init__(self, directory: str, capacity: int) -> None:
        self.path = os.path.join(directory, f"ring-{os.getpid()}-{secrets.token_hex(4)}")
        self.capacity = capacity
        self._map = map_file(self.path, _HEADER + capacity, create=True)
        self._read_cursor = np.ndarray((1,), dtype=np.uint64, buffer=self._map, offset=0)
        self._write = 0

    def write(self, payload: memoryview) -> tuple[int, int] | None:
        """Copies `payload` in; returns (offset, end cursor), or None if it does not fit now."""
        size = len(payload)
        pos = self._write % self.capacity
        start = self._write if pos + size <= self.capacity else self._write + self.capacity - pos
        end = start + size
        if end - int(self._read_cursor[0]) > self.capacity:
            return None
        offset = _HEADER + start % self.capacity
        self._map[offset : offset + size] = payload
        self._write = end
        return offset, end

    def close(self) -> None:
        del self._read_cursor  # (a view of the map: it must go before the map can close)
        self._map.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class ShmRingReader:
    def __init__(self, path: str) -> None:
        self._map = map_file(path, os.path.getsize(path), create=False)
        self._read_cursor = np.ndarray((1,), dtype=np.uint64, buffer=self._map, offset=0)

    def read(self, offset: int, size: int, end: int) -> bytes:
        data = self._map[offset : offset + size]
        self._read_cursor[0] = end
        return data

    def decode(self, decoder, offset: int, size: int, end: int):
        """Decodes a payload straight from the ring (no copy out), then frees its space."""
        with memoryview(self._map)[offset : offset + size] as view:
            msg = decoder.decode(view)
        self._read_cursor[0] = end
        return msg

    def close(self) -> None:
        del self._read_cursor  # (a view of the map: it must go before the map can close)
        self._map.close()
