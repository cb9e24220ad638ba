"""The workers behind the router: their health (a worker that stops answering is taken out, and put back
when it answers again), what they say of themselves (/v1/sluice/worker), and their prefix-cache events
(a ZeroMQ SUB socket each, feeding the KV index)."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Sequence

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from sluice.ipc.kv import KvEvents
from sluice.router.policy import KvIndex, Load

log = logging.getLogger("sluice.router")
_events = msgspec.msgpack.Decoder(KvEvents)
_HEALTH_TIMEOUT_S = 2.0


@dataclass
class Worker:
    url: str
    kind: str  # replica, context, generation
    up: bool = False
    failures: int = 0
    block_size: int = 16
    events_address: str | None = None
    model_root: str | None = None
    load: Load = field(default_factory=Load)
    _sub: zmq.asyncio.Socket | None = None
    _task: asyncio.Task | None = None


class Workers:
    def __init__(self, urls: dict[str, list[str]], index: KvIndex, interval: float, failures: int,
                 auth: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """`auth`: the header every call to a worker carries (the router's --worker-api-key)."""
        self._auth = {k.decode(): v.decode() for k, v in auth}
        self._refused: set[str] = set()  # URLs whose refusal was logged
        self.all = [Worker(u.rstrip("/"), kind) for kind, us in urls.items() for u in us]
        self.index = index
        self.interval = interval
        self.failures = failures
        self._ctx = zmq.asyncio.Context()
        self.client: aiohttp.ClientSession | None = None  # the router's, once its event loop runs

    def up(self, kind: str) -> list[Worker]:
        return [w for w in self.all if w.kind == kind and w.up]

    def by_url(self, url: str) -> Worker:
        return next(w for w in self.all if w.url == url)

    async def run(self) -> None:
        """Checks every worker each interval, for the router's life."""
        while True:
            await asyncio.gather(*(self.check(w) for w in self.all))
            await asyncio.sleep(self.interval)

    async def check(self, w: Worker) -> None:
        try:
            ok = await self._get(w.url + "/health") is not None
            if ok and not w.up:
                await self._describe(w)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, msgspec.MsgspecError, KeyError):
            ok = False
        if ok:
            if not w.up:
                log.info("worker %s is up", w.url)
            w.up, w.failures = True, 0
        else:
            w.failures += 1
            if w.up and w.failures >= self.failures:
                self.take_out(w, "it stopped answering its health checks")

    def take_out(self, w: Worker, why: str) -> None:
        if w.up:
            log.warning("worker %s is out: %s", w.url, why)
        w.up = False
        self.index.clear(w.url)  # what it holds is unknown until its next snapshot

    async def _get(self, url: str) -> bytes | None:
        """The body of a 200 answer (None: another status)."""
        assert self.client is not None
        async with self.client.get(url, timeout=aiohttp.ClientTimeout(total=_HEALTH_TIMEOUT_S),
                                   headers=self._auth) as r:
            if r.status in (401, 403) and url not in self._refused:
                self._refused.add(url)
                log.error("%s refuses the router's key (%d): give the router --worker-api-key", url, r.status)
            return await r.read() if r.status == 200 else None

    async def _describe(self, w: Worker) -> None:
        raw = await self._get(w.url + "/v1/sluice/worker")
        info = msgspec.json.decode(raw) if raw else {}  # (an older server: no events, routed by load)
        w.block_size = info.get("block_size", w.block_size)
        if info.get("kv_events") != w.events_address:
            self._unsubscribe(w)
            w.events_address = info.get("kv_events")
            if w.events_address:
                self._subscribe(w)
        try:
            w.model_root = msgspec.json.decode(await self._get(w.url + "/v1/models") or b"{}")["data"][0].get("root")
        except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.MsgspecError, KeyError, IndexError,
                AttributeError):
            pass

    def _subscribe(self, w: Worker) -> None:
        assert w.events_address is not None
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(w.events_address)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        w._sub = sock
        w._task = asyncio.create_task(self._follow(w, sock))

    def _unsubscribe(self, w: Worker) -> None:
        if w._task is not None:
            w._task.cancel()
        if w._sub is not None:
            w._sub.close()
        w._sub = w._task = None

    async def _follow(self, w: Worker, sock: zmq.asyncio.Socket) -> None:
        """The worker's events into the index; a lost message (a gap in seq) asks for a snapshot again."""
        expect = None
        while True:
            events = _events.decode(await sock.recv())
            if not events.snapshot and expect is not None and events.seq != expect:
                log.info("worker %s: KV events lost, asking for a snapshot", w.url)
                sock.setsockopt(zmq.UNSUBSCRIBE, b"")
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                expect = None
                continue
            if events.snapshot or expect is not None:
                self.index.apply(w.url, events)
                expect = events.seq + 1

    def close(self) -> None:
        for w in self.all:
            self._unsubscribe(w)
