"""Small ASGI helpers: read a body, send a response, errors in the OpenAI shape."""
from __future__ import annotations

import asyncio
import re
from typing import Sequence

import msgspec

from ipc.openai import error_body

JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_PARAM = re.compile(r"at `\$\.([^`]+)`")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


class BodyTooLarge(Exception):
    pass


class BodyTimedOut(Exception):
    pass


async def read_body(receive, limit: int, timeout: float) -> bytes:
    """The whole body within `timeout` seconds: a client that trickles its body in would otherwise hold
    the connection, and what it sent so far, for as long as it liked."""
    try:
        return await asyncio.wait_for(_read_chunks(receive, limit), timeout)
    except asyncio.TimeoutError:
        raise BodyTimedOut() from None


async def _read_chunks(receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectionResetError("client went away")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge()
        chunks.append(chunk)
        if not msg.get("more_body"):
            return b"".join(chunks)


async def respond(send, status: int, body: bytes, headers: list = JSON) -> int:
    """Sends a whole response; returns its status."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
    return status


async def respond_error(send, status: int, message: str, param: str | None = None, code=None,
                        extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> int:
    return await respond(send, status, error_body(status, message, param, code), JSON + list(extra_headers))


def validation_error(e: msgspec.MsgspecError) -> tuple[str, str | None]:
    """An OpenAI-style message and param for a msgspec decode/validation error."""
    text = str(e)
    if isinstance(e, msgspec.DecodeError) and not isinstance(e, msgspec.ValidationError):
        return f"invalid JSON body: {text}", None
    for pattern in (_UNKNOWN, _MISSING, _PARAM):
        if m := pattern.search(text):
            field = m.group(1)
            if pattern is _UNKNOWN:
                return f"unknown field {field!r}: this server does not support it", field
            return text, field
    return text, None
