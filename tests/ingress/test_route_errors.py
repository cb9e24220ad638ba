"""A route that fails unexpectedly answers in its dialect's shape, never granian's plain-text 500; once its
response began, the failure cuts the connection (a response cut short must not pass for a whole one)."""
from __future__ import annotations

import asyncio
import functools
import json
from types import SimpleNamespace

import pytest

from sluice.ingress.anthropic import MESSAGES
from sluice.ingress.app import Ingress
from sluice.ingress.routes import Request, Route


def _run(handler, dialect=MESSAGES) -> list[dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    ingress = SimpleNamespace(draining=False)
    ingress.respond_failure = functools.partial(Ingress.respond_failure, ingress)
    route = Route("GET", "/v1/things/{id}", handler, dialect)
    asyncio.run(Ingress._handle(ingress, route, Request({"headers": []}, {"id": "x"}), None, send, dialect))
    return sent


def test_an_exception_before_the_response_is_a_500_in_the_routes_dialect():
    async def broken(ingress, request, receive, send) -> int:
        raise OverflowError("Python int too large to convert to SQLite INTEGER")

    start, body = _run(broken)
    assert start["status"] == 500 and (b"content-type", b"application/json") in start["headers"]
    error = json.loads(body["body"])
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "GET /v1/things/{id}" in error["error"]["message"]


def test_an_exception_after_the_response_began_cuts_it():
    async def cut(ingress, request, receive, send) -> int:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise OverflowError("mid-body")

    with pytest.raises(OverflowError):
        _run(cut)
