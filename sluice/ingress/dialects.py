"""The API dialects the ingress speaks. A dialect names its generation route and request Struct (validated
here: a bad body is a 400 in that dialect's shape), the id its responses carry, and how its errors look,
as a whole body or as an event in a stream that already began. Everything after the request is the one
chat core's (render translates, postproc frames)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import msgspec

from sluice.ipc.messages import Endpoint, Failure, Frame
from sluice.schemas.errors import OPENAI, ErrorShape
from sluice.schemas.openai import ChatCompletionRequest, CompletionRequest

Send = Callable[[dict], Awaitable[None]]


@dataclass(frozen=True)
class Dialect:
    endpoint: Endpoint
    path: str  # its POST route
    request_type: type
    id_prefix: str  # of the ids its responses carry
    errors: ErrorShape  # its errors' bodies, stream events and statuses (ipc.errors)
    stream_headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # beyond the SSE ones
    # Headers of its own on every response on the dialect's routes, made fresh for each (Anthropic's
    # request-id).
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
        if not self.errors.statuses and self.response_headers is None:
            return send
        statuses, headers = self.errors.statuses, self.response_headers

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


DIALECTS: dict[str, Dialect] = {}  # by route
# A dialect's keeper of what it stores (by endpoint): given a request, what to call with its last frame
# before it goes out (a Failure then: the response is not delivered as one), None when the request stores
# nothing, or a Failure when storing cannot be done (said before the work). ingress/stored_chat.py's.
Keep = Callable[[Frame], Awaitable[Failure | None]]
KEEPERS: dict[Endpoint, Callable[[Any, Any], Awaitable[Keep | Failure | None]]] = {}


def register(dialect: Dialect) -> Dialect:
    DIALECTS[dialect.path] = dialect
    return dialect


OPENAI_CHAT = register(Dialect("chat", "/v1/chat/completions", ChatCompletionRequest, "chatcmpl-", OPENAI))
OPENAI_COMPLETIONS = register(Dialect("completions", "/v1/completions", CompletionRequest, "cmpl-", OPENAI))
