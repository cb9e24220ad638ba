"""Typed ZeroMQ channels. Stage code sees put/get of messages, never sockets.

A payload of at least `shm_threshold` bytes goes through a shared-memory ring
(see ipc/shm.py) with a small descriptor on the socket; the threshold comes
from bench/transport.py (bench/RESULTS.md#ipc-transport).
"""
from __future__ import annotations

from typing import Any, Generic, TypeVar, overload

import msgspec
import zmq
import zmq.asyncio

from sluice.ipc.shm import ShmRingReader, ShmRingWriter

T = TypeVar("T")

DEFAULT_SHM_THRESHOLD = 1 << 20
DEFAULT_RING_BYTES = 64 << 20
_SHM_TAG = b"\x00shm"
_POLLIN = int(zmq.POLLIN)  # an int: & with the IntFlag runs enum code in Python
_descriptor = msgspec.msgpack.Encoder()
_descriptor_decode = msgspec.msgpack.Decoder(tuple[str, int, int, int])


class PushChannel(Generic[T]):
    def __init__(
        self,
        ctx: zmq.Context,
        address: str | list[str],
        *,
        bind: bool = False,
        shm_dir: str | None = None,
        shm_threshold: int = DEFAULT_SHM_THRESHOLD,
        ring_bytes: int = DEFAULT_RING_BYTES,
    ) -> None:
        """`shm_dir` None: every payload goes inline over the socket."""
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        # Several addresses: messages are dealt round-robin among them.
        for addr in [address] if isinstance(address, str) else address:
            (self._sock.bind if bind else self._sock.connect)(addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._shm_dir = shm_dir
        self._threshold = shm_threshold
        self._ring_bytes = ring_bytes
        self._ring: ShmRingWriter | None = None

    def put(self, msg: T) -> None:
        self.put_bytes(self._encoder.encode(msg))

    def put_bytes(self, payload: bytes) -> None:
        if self._shm_dir is not None and len(payload) >= self._threshold:
            if self._ring is None:
                self._ring = ShmRingWriter(self._shm_dir, self._ring_bytes)
            placed = self._ring.write(memoryview(payload))
            if placed is not None:
                offset, end = placed
                desc = _descriptor.encode((self._ring.path, offset, len(payload), end))
                self._sock.send_multipart([_SHM_TAG, desc], copy=False)
                return
        self._sock.send(payload, copy=False)

    def close(self) -> None:
        self._sock.close()
        if self._ring is not None:
            self._ring.close()


class _Unpacker(Generic[T]):
    def __init__(self, msg_type: Any) -> None:  # a Struct type, or a tagged union of them
        self._decoder = msgspec.msgpack.Decoder(msg_type)
        self._rings: dict[str, ShmRingReader] = {}

    def decode(self, frames: list) -> T:
        if len(frames) == 1:
            return self._decoder.decode(frames[0].buffer)
        path, offset, size, end = _descriptor_decode.decode(frames[1].buffer)
        ring = self._rings.get(path)
        if ring is None:
            ring = self._rings[path] = ShmRingReader(path)
        return ring.decode(self._decoder, offset, size, end)

    def close(self) -> None:
        for ring in self._rings.values():
            ring.close()


class PullChannel(Generic[T]):
    """Receiver: blocking for the engine, render and postproc loops; an ingress worker reads it when its `fd` is
    readable."""

    def __init__(self, ctx: zmq.Context, address: str, msg_type: Any, *, bind: bool = True) -> None:
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        (self._sock.bind if bind else self._sock.connect)(address)
        self._unpack: _Unpacker[T] = _Unpacker(msg_type)
        self._wait = -1  # RCVTIMEO, ms (-1: none)

    @overload
    def get(self, timeout: None = None) -> T: ...

    @overload
    def get(self, timeout: float) -> T | None: ...

    def get(self, timeout: float | None = None) -> T | None:
        """The next message, or None after `timeout` seconds (None waits forever). The wait is the receive's
        own (RCVTIMEO, set when it changes): a loop that waits with a timeout between messages pays no poll."""
        wait = -1 if timeout is None else int(timeout * 1000)
        if wait != self._wait:
            self._sock.setsockopt(zmq.RCVTIMEO, wait)
            self._wait = wait
        try:
            return self._unpack.decode(self._sock.recv_multipart(copy=False))
        except zmq.Again:
            return None

    @property
    def fd(self) -> int:
        """A descriptor that becomes readable when messages arrive (for an event loop's reader: it signals once
        for all that came, so the reader drains)."""
        return self._sock.get(zmq.FD)

    def get_nowait(self) -> T | None:
        try:
            frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self._unpack.decode(frames)

    def drain(self) -> list[T]:
        """Every message waiting now. ZeroMQ says whether one waits: asking costs about half of a receive that
        fails (the engine and the postproc drain on every loop, mostly finding nothing)."""
        out = []
        while self._sock.get(zmq.EVENTS) & _POLLIN:
            out.append(self._unpack.decode(self._sock.recv_multipart(copy=False)))
        return out

    def close(self) -> None:
        self._sock.close()
        self._unpack.close()


class SubChannel(Generic[T]):
    """Receives the supervisor's broadcasts (asyncio)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, msg_type: Any) -> None:
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(address)
        self._decoder = msgspec.msgpack.Decoder(msg_type)

    async def get(self) -> T:
        return self._decoder.decode(await self._sock.recv())

    def close(self) -> None:
        self._sock.close(linger=0)


class PubChannel(Generic[T]):
    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self._sock = ctx.socket(zmq.PUB)
        self._sock.bind(address)
        self._encoder = msgspec.msgpack.Encoder()

    def put(self, msg: T) -> None:
        self._sock.send(self._encoder.encode(msg))

    def close(self) -> None:
        self._sock.close(linger=0)


class PushPool(Generic[T]):
    """One lazily connected PushChannel per destination address (replies to ingress workers)."""

    def __init__(self, ctx: zmq.Context, **channel_kwargs) -> None:
        self._ctx = ctx
        self._kwargs = channel_kwargs
        self._channels: dict[str, PushChannel[T]] = {}

    def get(self, address: str) -> PushChannel[T]:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = PushChannel(self._ctx, address, **self._kwargs)
        return ch

    def drop(self, address: str) -> None:
        """Closes the channel to a destination that is gone (and whatever it still queued for it)."""
        ch = self._channels.pop(address, None)
        if ch is not None:
            ch._sock.setsockopt(zmq.LINGER, 0)
            ch.close()

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
