"""Small ASGI helpers: read a body, send a response, errors in the OpenAI shape."""
from __future__ import annotations

import asyncio
import re
from typing import Sequence

import msgspec

from sluice.ipc.messages import Failure
from sluice.schemas.openai import error_body

JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_PARAM = re.compile(r"at `\$\.([^`]+)`")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")
# An error says at most this many characters, a few hundred (a 1 MB field name does not come back whole), its
# param (a field's path) at most MAX_PARAM of them
MAX_MESSAGE, MAX_PARAM = 512, 256


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
    """An OpenAI-style message and param for a msgspec decode/validation error, each at most MAX_MESSAGE
    characters."""
    text = str(e)
    if isinstance(e, msgspec.DecodeError) and not isinstance(e, msgspec.ValidationError):
        return capped(f"invalid JSON body: {text}"), None
    for pattern in (_UNKNOWN, _MISSING, _PARAM):
        if m := pattern.search(text):
            field = capped(m.group(1), MAX_PARAM)
            if pattern is _UNKNOWN:
                return capped(f"unknown field {field!r}: this server does not support it"), field
            return capped(text), field
    return capped(text), None


def capped(text: str, limit: int = MAX_MESSAGE) -> str:
    """`text` within `limit` characters: a longer one (a client's value it echoes) keeps its head and its last
    quarter (what the message says after the value), and says how much was left out between."""
    if len(text) <= limit:
        return text
    tail = limit // 4
    head = limit - tail - 48  # (room for the note: its count has at most 22 digits)
    return f"{text[:head]} ...({len(text) - head - tail} more characters)... {text[len(text) - tail:]}"


def capped_failure(failure: Failure) -> Failure:
    """`failure` within MAX_MESSAGE and MAX_PARAM (the message leaves room for the param: Anthropic's says it)."""
    if len(failure.message) + len(failure.param or "") + 2 <= MAX_MESSAGE:
        return failure
    param = failure.param and capped(failure.param, MAX_PARAM)
    return msgspec.structs.replace(failure, param=param,
                                   message=capped(failure.message, MAX_MESSAGE - len(param or "") - 2))


def header(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    return next((v for k, v in headers if k.lower() == name), None)
