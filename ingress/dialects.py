"""The API dialects the ingress speaks. A dialect names its generation route and request Struct (validated
here: a bad body is a 400 in that dialect's shape), the id its responses carry, and how its errors look,
as a whole body or as an event in a stream that already began. Everything after the request is the one
chat core's (render translates, postproc frames)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import msgspec

from ipc.messages import Endpoint, Failure
from ipc.openai import ChatCompletionRequest, CompletionRequest, error_body

Send = Callable[[dict], Awaitable[None]]


@dataclass(frozen=True)
class Dialect:
    endpoint: Endpoint
    path: str  # its POST route
    request_type: type
    id_prefix: str  # of the ids its responses carry
    error_body: Callable[[Failure], bytes]
    stream_error: Callable[[Failure], bytes]  # the event that ends a stream in an error
    stream_headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # beyond the SSE ones
    # Every response on the dialect's routes: statuses it answers instead of the core's (Anthropic's 529 for
    # 503), and headers of its own, made fresh for each response (Anthropic's request-id).
    statuses: dict[int, int] = field(default_factory=dict)
    response_headers: Callable[[], list[tuple[bytes, bytes]]] | None = None
    # An event a stream sends every keepalive_s while the engine is busy before the first token (the
    # stream begins before it, once the request is rendered); empty: the response waits for the token.
    keepalive: bytes = b""
    keepalive_s: float = 1.0
    # What the dialect refuses beyond its Struct's types (msgspec.ValidationError, a 400), checked once a body
    # is decoded
    check: Callable[[Any], None] | None = None
    decoder: msgspec.json.Decoder = field(init=False)

    def __post_init__(self) -> None:  # (one decoder a type: a per-request copy of a dialect builds none)
        object.__setattr__(self, "decoder", _decoder(self.request_type))

    def streams(self, request: Any) -> bool:
        return bool(getattr(request, "stream", False))

    def wrap_send(self, send: Send) -> Send:
        """`send` with the dialect's statuses and headers (itself, for a dialect that has none)."""
        if not self.statuses and self.response_headers is None:
            return send
        statuses, headers = self.statuses, self.response_headers

        async def wrapped(message: dict) -> None:
            if message["type"] == "http.response.start":
                extra = headers() if headers is not None else []
                message = {**message, "status": statuses.get(message["status"], message["status"]),
                           "headers": [*message.get("headers", []), *extra]}
            await send(message)
        return wrapped


@functools.cache
def _decoder(request_type: type) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(request_type)


def openai_error(f: Failure) -> bytes:
    return error_body(f.status, f.message, f.param, f.code)


def openai_stream_error(f: Failure) -> bytes:
    return b"data: " + openai_error(f) + b"\n\ndata: [DONE]\n\n"


DIALECTS: dict[str, Dialect] = {}  # by route


def register(dialect: Dialect) -> Dialect:
    DIALECTS[dialect.path] = dialect
    return dialect


OPENAI_CHAT = register(Dialect("chat", "/v1/chat/completions", ChatCompletionRequest, "chatcmpl-", openai_error,
                               openai_stream_error))
OPENAI_COMPLETIONS = register(Dialect("completions", "/v1/completions", CompletionRequest, "cmpl-", openai_error,
                                      openai_stream_error))
