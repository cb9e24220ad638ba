"""msgpack request bodies and responses: a msgpack body is read as the JSON body with the same fields (one
decode path after it: the same validation, errors and render job), and a client whose Accept prefers msgpack
gets its whole JSON responses as msgpack. Streams stay SSE."""
from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import msgspec

from sluice.ingress.http import header

MSGPACK = b"application/msgpack"
_MSGPACK_TYPES = (MSGPACK, b"application/x-msgpack")
_msgpack_any = msgspec.msgpack.Decoder()
_json = msgspec.json.Encoder()


def _media_type(value: bytes) -> bytes:
    return value.split(b";", 1)[0].strip().lower()


def sends_msgpack(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """Whether the request's body is msgpack: its Content-Type says so, or trtllm-serve's orchestrator's
    `X-TRTLLM-Msgpack: 1` does (it sends msgpack under a JSON Content-Type)."""
    content_type = header(headers, b"content-type")
    return (content_type is not None and _media_type(content_type) in _MSGPACK_TYPES) or \
        header(headers, b"x-trtllm-msgpack") == b"1"


class BadMsgpack(ValueError):
    """A msgpack body that is not msgpack, or holds what JSON cannot (a 400)."""


def msgpack_as_json(body: bytes) -> bytes:
    """A msgpack body as the JSON body with the same fields, so that it is validated, refused and rendered
    exactly as JSON is. What JSON has no form for is refused here: NaN or infinite numbers, keys that are not
    strings, bin, timestamps and other extension types."""
    try:
        value = _msgpack_any.decode(body)
    except msgspec.DecodeError as e:
        raise BadMsgpack(str(e)) from None
    if (what := _not_json(value)) is not None:
        raise BadMsgpack(f"it holds {what}, which JSON has no form for")
    return _json.encode(value)


_JSON_KINDS = {dict, list, str, int, float, bool, type(None)}
_NAMES = {bytes: "a bin value", msgspec.msgpack.Ext: "an extension type"}


def _not_json(value: Any) -> str | None:
    """What in a decoded msgpack value JSON has no form for (None: nothing). Iterative, so that a deep body
    cannot reach the recursion limit here, and each container's items are looked at by type in C (a prompt of
    token ids is a list of 100k ints)."""
    stack: list[dict | list] = [[value]]
    while stack:
        v = stack.pop()
        items: Iterable[Any] = v
        if type(v) is dict:
            if not set(map(type, v)) <= {str}:
                return "a key that is not a string"
            items = v.values()
        kinds = set(map(type, items))
        if not kinds <= _JSON_KINDS:
            odd = next(iter(kinds - _JSON_KINDS))
            return _NAMES.get(odd, f"a {odd.__name__}")
        if float in kinds and not all(map(math.isfinite, (x for x in items if type(x) is float))):
            return "a NaN or infinite number"
        if dict in kinds or list in kinds:
            stack.extend(x for x in items if type(x) is dict or type(x) is list)
    return None


def accepts_msgpack(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """Whether the request's Accept prefers msgpack to JSON (by q value; the first listed on a tie)."""
    accept = header(headers, b"accept")
    if not accept or b"msgpack" not in accept:
        return False
    best, best_q = b"", 0.0
    for part in accept.split(b","):
        media, *params = part.split(b";")
        q = 1.0
        for p in params:
            name, _, value = p.strip().partition(b"=")
            if name.strip().lower() == b"q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if q > best_q:
            best, best_q = _media_type(media), q
    return best in _MSGPACK_TYPES


def msgpack_responses(send):
    """`send` with each whole JSON response turned into msgpack (streams and other types go as they are)."""
    held: dict | None = None
    chunks: list[bytes] = []

    async def transcode(message: dict) -> None:
        nonlocal held
        if message["type"] == "http.response.start":
            content_type = header(message.get("headers", []), b"content-type")
            if content_type is not None and _media_type(content_type) == b"application/json":
                held = message
                return
        elif held is not None and message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            start, body, held = held, b"".join(chunks), None
            chunks.clear()
            try:
                body = msgspec.msgpack.encode(msgspec.json.decode(body))
            except msgspec.DecodeError:  # (not JSON after all: it goes as it came)
                pass
            else:
                headers = [(k, v) for k, v in start.get("headers", [])
                           if k.lower() not in (b"content-type", b"content-length")]
                start = {**start, "headers": [*headers, (b"content-type", MSGPACK)]}
            await send(start)
            message = {**message, "body": body}
        await send(message)
    return transcode
