"""A lean HTTP/1.1 client for streaming benchmarks: raw asyncio sockets, keep-alive, chunked
transfer decoding, and SSE events scanned as bytes (JSON is parsed only for the usage event)."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0  # seconds to the first event with output
    e2e: float = 0.0
    gaps: list[float] = field(default_factory=list)  # between events with output
    prompt_tokens: int = 0
    output_tokens: int = 0


class Connection:
    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        u = urlsplit(base_url)
        if u.hostname is None:
            raise ValueError(f"no host in {base_url!r}")
        self.host, self.port = u.hostname, u.port or 80
        self.prefix = u.path.rstrip("/")
        self.auth = f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _ensure(self) -> asyncio.StreamWriter:
        """Connects unless connected; returns the writer."""
        # a server that closed a kept-alive connection (llama-server's cpp-httplib does after 5 s idle or 100
        # requests) has left its reader at EOF: connect anew rather than send into it
        if self.writer is None or self.writer.is_closing() or (self.reader is not None and self.reader.at_eof()):
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 22)
        return self.writer

    def _reader(self) -> asyncio.StreamReader:
        assert self.reader is not None, "read before _ensure() connected"
        return self.reader

    async def post_sse(self, path: str, body: dict) -> Result:
        """POSTs a streaming request and times its events."""
        res = Result(start=time.perf_counter())
        try:
            payload = json.dumps(body).encode()
            for attempt in (0, 1):  # a kept-alive connection the server closed meanwhile: once more, on a new one
                reused = self.writer is not None
                writer = await self._ensure()
                writer.write(b"POST " + (self.prefix + path).encode() + b" HTTP/1.1\r\nHost: " +
                             self.host.encode() + b"\r\nContent-Type: application/json\r\n" + self.auth +
                             b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
                try:
                    status, chunked, length = await self._headers()
                    break
                except ConnectionResetError:
                    writer.close()
                    self.writer = None
                    if not reused or attempt:
                        raise
            if status != 200:
                await self._read_body(chunked, length)
                res.error = f"http {status}"
                return res
            last = 0.0
            async for event in self._events(chunked, length):  # read to the body's end: the connection is reused
                now = time.perf_counter()
                if event.startswith(b"data: [DONE]"):
                    continue
                if b'"completion_tokens"' in event:  # the usage event
                    usage = json.loads(event[6:])["usage"]
                    res.prompt_tokens, res.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                if _has_output(event):
                    if not res.ttft:
                        res.ttft = now - res.start
                    else:
                        res.gaps.append(now - last)
                    last = now
                elif b'"error"' in event:
                    res.error = "error event"
            res.e2e = time.perf_counter() - res.start
            res.ok = not res.error and res.output_tokens > 0
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as e:
            res.error = type(e).__name__
            if self.writer is not None:
                self.writer.close()
            self.writer = None
        return res

    async def _headers(self) -> tuple[int, bool, int]:
        reader = self._reader()
        line = await reader.readline()
        if not line:
            raise ConnectionResetError("the server closed the connection before answering")
        status = int(line.split()[1])
        chunked, length = False, 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"content-length":
                length = int(value)
        return status, chunked, length

    async def _read_body(self, chunked: bool, length: int) -> bytes:
        return b"".join([c async for c in self._chunks(chunked, length)])

    async def _chunks(self, chunked: bool, length: int):
        reader = self._reader()
        if not chunked:
            yield await reader.readexactly(length)
            return
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]

    async def _events(self, chunked: bool, length: int):
        buf = b""
        async for chunk in self._chunks(chunked, length):
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            for event in events:
                yield event


def _has_output(event: bytes) -> bool:
    """Whether an SSE event carries generated text (content, reasoning, tool-call arguments or completion text)."""
    for key in (b'"content":"', b'"text":"', b'"reasoning_content":"', b'"arguments":"'):
        i = event.find(key)
        if i >= 0 and event[i + len(key): i + len(key) + 1] != b'"':
            return True
    return False
