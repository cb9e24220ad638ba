"""How each dialect says an error: one table, used by the ingress and the router alike. A shape gives the
whole error body for a status, the event that ends a stream that already began, and the statuses the
dialect answers instead of the core's (Anthropic's 529 for a full server)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

import msgspec

from sluice.schemas.anthropic import error_response
from sluice.schemas.openai import error_body
from sluice.schemas.responses import ErrorEvent, sse

_json = msgspec.json.Encoder()


class Failure(Protocol):
    """An error in no dialect yet (sluice.ipc.messages.Failure, as it crosses the stages)."""

    @property
    def status(self) -> int: ...
    @property
    def message(self) -> str: ...
    @property
    def code(self) -> str | None: ...
    @property
    def param(self) -> str | None: ...


@dataclass(frozen=True)
class ErrorShape:
    body: Callable[[Failure], bytes]
    stream: Callable[[Failure, int], bytes]  # the event that ends a stream in an error (after the events sent:
    # the number the next event takes, where the dialect numbers them)
    statuses: Mapping[int, int] = field(default_factory=dict)

    def status(self, status: int) -> int:
        return self.statuses.get(status, status)


def _openai_body(f: Failure) -> bytes:
    return error_body(f.status, f.message, f.param, f.code)


def _anthropic_body(f: Failure) -> bytes:
    return _json.encode(error_response(f.status, f.message, f.param))


OPENAI = ErrorShape(_openai_body, lambda f, _: b"data: " + _openai_body(f) + b"\n\ndata: [DONE]\n\n")
ANTHROPIC = ErrorShape(_anthropic_body, lambda f, _: b"event: error\ndata: " + _anthropic_body(f) + b"\n\n",
                       statuses={503: 529})
# (a served response's stream says more: sluice.ingress.responses.Kept)
RESPONSES = ErrorShape(_openai_body, lambda f, sequence: sse(ErrorEvent(sequence_number=sequence, code=f.code,
                                                                        message=f.message, param=f.param)))


def for_path(path: str) -> ErrorShape:
    """The shape of the errors on a route (the OpenAI one outside the other dialects' routes)."""
    if path.startswith("/v1/messages"):
        return ANTHROPIC
    return RESPONSES if path.startswith("/v1/responses") else OPENAI
