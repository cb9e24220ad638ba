"""The router's requests to its workers: one sent to a worker and its answer relayed to the client as it comes
(a client that leaves closes the worker's connection, and the worker aborts), and the answers the router gives
itself in the route's dialect."""
from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from sluice.base.disagg import PARAMS_HEADER, SECRET_HEADER
from sluice.router import errors
from sluice.router.metrics import DECISIONS, TRANSFER_SECONDS
from sluice.router.workers import Worker, Workers

log = logging.getLogger("sluice.router")
TRANSPORT = (aiohttp.ClientError, asyncio.TimeoutError)  # a worker that cannot be reached, or failed mid-answer
HOP = {b"host", b"content-length", b"connection", b"transfer-encoding", b"keep-alive", SECRET_HEADER, PARAMS_HEADER}


class Failed(Exception):
    """A worker could not take the request (connection refused, reset before an answer)."""


class Relay:
    """Requests to workers on the router's client session; a worker that cannot be reached is taken out of
    `workers`."""

    def __init__(self, workers: Workers) -> None:
        self.workers = workers
        self.client: aiohttp.ClientSession | None = None  # (made in the event loop, at start)

    def post(self, url: str, body: bytes, headers: list[tuple[bytes, bytes]]):
        assert self.client is not None
        return self.client.post(url, data=body, headers=str_headers(headers))

    async def relay_or_fail(self, worker: Worker, path: str, body: bytes, headers: list, receive, send,
                            blocks: int, transfer: bool = False, plain: bytes | None = None) -> int:
        try:
            return await self.relay(worker, path, body, headers, receive, send, blocks, transfer, plain)
        except Failed:
            return await error(send, path, 503, f"worker {worker.url} failed; retry", retry=True)

    async def relay(self, worker: Worker, path: str, body: bytes, headers: list, receive, send, blocks: int,
                    transfer: bool = False, plain: bytes | None = None) -> int:
        """Sends the request to `worker` and its response, as it comes, to the client. Failed when the worker
        failed before answering (nothing was sent to the client: another may take it). `plain`: the request
        without the hand-off, for a worker that refuses disaggregated_params (an older version)."""
        worker.load.add(blocks)
        t0 = time.perf_counter()
        try:
            try:
                resp = await self.post(worker.url + path, body, headers)
            except TRANSPORT as e:
                self.workers.take_out(worker, f"a request failed: {e!r}")
                raise Failed() from e
            if transfer:
                TRANSFER_SECONDS.observe(time.perf_counter() - t0)  # the KV read and the first token
            first = b""
            if plain is not None and resp.status in (400, 403):
                first = await resp.read()
                if b"disaggregated_params" in first:
                    resp.release()
                    DECISIONS.labels("handoff_refused").inc()
                    headers = [(k, v) for k, v in headers if k not in (SECRET_HEADER, PARAMS_HEADER)]
                    return await self.relay(worker, path, plain, headers, receive, send, 0)
            return await self._stream(resp, first, path, receive, send)
        finally:
            worker.load.done(blocks)

    async def _stream(self, resp: aiohttp.ClientResponse, first: bytes, path: str, receive, send) -> int:
        """Relays a response's bytes; a client that leaves closes the worker's connection (the worker aborts)."""
        relay = asyncio.create_task(self._copy(resp, first, path, send))
        gone = asyncio.create_task(disconnected(receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            if relay.done():
                return relay.result()
            relay.cancel()
            resp.close()  # (not released to the pool: the worker sees the connection close)
            return resp.status
        finally:
            gone.cancel()
            resp.release()

    async def _copy(self, resp: aiohttp.ClientResponse, first: bytes, path: str, send) -> int:
        headers = [(k, v) for k, v in resp.raw_headers if k.lower() not in HOP]
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        if first:  # (read already: an error body looked at)
            await send({"type": "http.response.body", "body": first, "more_body": False})
            return resp.status
        try:
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except TRANSPORT:  # the worker died mid-response: the client hears it in its dialect
            log.warning("a worker failed mid-response on %s", path)
            await send({"type": "http.response.body", "more_body": False, "body": errors.stream_event(
                path, 502, "the worker serving this request failed; retry it", "worker_failed")})
            return resp.status
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return resp.status


def str_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]




async def read_body(receive, limit: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return b"".join(chunks)
        chunks.append(msg.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return None
        if not msg.get("more_body"):
            return b"".join(chunks)


async def disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def error(send, path: str, status: int, message: str, code: str | None = None, retry: bool = False,
                 extra: tuple[tuple[bytes, bytes], ...] = ()) -> int:
    """An error the router answers itself, in the dialect of the route (its body, its status)."""
    return await respond(send, errors.status(path, status), errors.body(path, status, message, code), retry=retry,
                          extra=extra)


async def respond(send, status: int, body: bytes, content_type: str | bytes | None = None,
                   retry: bool = False, extra: tuple[tuple[bytes, bytes], ...] = ()) -> int:
    ctype = content_type.encode() if isinstance(content_type, str) else content_type or b"application/json"
    headers = [(b"content-type", ctype)] + ([(b"retry-after", b"1")] if retry else []) + list(extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
    return status
