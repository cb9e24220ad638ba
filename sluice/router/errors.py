"""Errors the router itself answers, in the shape of the dialect the client speaks (sluice.schemas.errors, the table
the ingress uses too)."""
from __future__ import annotations

from sluice.ipc.messages import Failure
from sluice.schemas.errors import for_path


def body(path: str, status: int, message: str, code: str | None = None) -> bytes:
    return for_path(path).body(Failure(status, message, code))


def status(path: str, status: int) -> int:
    """The status the dialect answers for the core's (Anthropic's 529 for 503)."""
    return for_path(path).status(status)


def stream_event(path: str, status: int, message: str, code: str | None = None) -> bytes:
    """The event that ends a stream that began (its worker failed mid-stream)."""
    return for_path(path).stream(Failure(status, message, code), 0)
