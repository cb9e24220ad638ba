"""Errors the router itself answers, in the shape of the dialect the client speaks."""
from __future__ import annotations

import msgspec

from ipc.anthropic import error_response
from ipc.openai import error_body
from ipc.responses import ErrorEvent

_json = msgspec.json.Encoder()


def body(path: str, status: int, message: str, code: str | None = None) -> bytes:
    if path.startswith("/v1/messages"):
        return _json.encode(error_response(status, message))
    return error_body(status, message, None, code)


def stream_event(path: str, status: int, message: str, code: str | None = None) -> bytes:
    """The event that ends a stream that began (its worker failed mid-stream)."""
    if path.startswith("/v1/messages"):
        return b"event: error\ndata: " + body(path, status, message) + b"\n\n"
    if path.startswith("/v1/responses"):
        return b"event: error\ndata: " + _json.encode(ErrorEvent(sequence_number=0, code=code, message=message)) + \
            b"\n\n"
    return b"data: " + body(path, status, message, code) + b"\n\ndata: [DONE]\n\n"
