"""The prefix cache's block events, published for a KV-aware router (ipc/kv.py KvEvents).

An XPUB socket: every subscription (a router that connects, or one that lost a message and subscribes
again) is answered with a snapshot of every cached hash; after it, each step's stored and removed hashes.
Until the first subscription nothing is recorded (the snapshot covers what came before).
"""
from __future__ import annotations

import msgspec
import zmq

from sluice.base.disagg import bound_port
from sluice.engine.block_manager import BlockManager, CacheEvents
from sluice.ipc.kv import KvEvents

_POLLIN = int(zmq.POLLIN)  # an int: & with the IntFlag runs enum code in Python
_MAX_QUEUED = 10_000  # messages per subscriber before ZeroMQ drops (the subscriber then sees a gap)


class KvEventPublisher:
    def __init__(self, ctx: zmq.Context, address: str, bm: BlockManager) -> None:
        self.bm = bm
        self.events = CacheEvents()  # recorded by the block manager once a router subscribed: before, nobody reads them
        self._sock = ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, repeated ones too, asks for a snapshot
        self._sock.setsockopt(zmq.SNDHWM, _MAX_QUEUED)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self.port = bound_port(self._sock)
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()

    def publish(self) -> None:
        """Answers new subscriptions with a snapshot, or sends what changed since the last call."""
        snapshot = False
        while self._sock.get(zmq.EVENTS) & _POLLIN:  # (asking is cheaper than a receive that fails, each step)
            snapshot |= self._sock.recv()[:1] == b"\x01"
        if snapshot:
            self.bm.events = self.events
            self._send(KvEvents(self._seq, list(self.bm.cached), snapshot=True))
        elif self.events.stored or self.events.removed:
            self._send(KvEvents(self._seq, self.events.stored, self.events.removed))
        else:
            return
        self.events.stored, self.events.removed = [], []

    def _send(self, msg: KvEvents) -> None:
        self._seq += 1
        try:
            self._sock.send(self._encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def close(self) -> None:
        self._sock.close()
