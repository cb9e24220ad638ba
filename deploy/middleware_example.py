"""Example ASGI middleware for `sluice serve --middleware` (ingress/middleware.py loads it):

    sluice serve MODEL --middleware deploy/middleware_example.py:request_id \\
                       --middleware deploy/middleware_example.py:server_timing

request_id, given first, is the outer one: it sees each request first and its response last. A factory takes
the app and returns the app around it; the one it returns gets every scope (lifespan too) and passes on what
it does not handle. Copy this file and change it: it is loaded by path, so it need not be installed.
"""
from __future__ import annotations

import time
import uuid


def request_id(app):
    """Gives each HTTP request an id (the client's X-Request-Id where it sent one): in the scope's "state",
    for the middleware inside it, and in the response's X-Request-Id header."""

    async def middleware(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id")
        rid = given.decode("latin-1") if given else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid  # (what was in "state" stays)

        async def with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)
        await app(scope, receive, with_id)
    return middleware


def server_timing(app):
    """Says in a Server-Timing header how long the app took to begin its response, and which request id the
    middleware outside it gave (none when there is none)."""

    async def middleware(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        start = time.perf_counter()
        rid = scope.get("state", {}).get("request_id", "none")

        async def timed(message):
            if message["type"] == "http.response.start":
                ms = (time.perf_counter() - start) * 1000
                value = f'app;dur={ms:.1f};desc="{rid}"'.encode()
                message = {**message, "headers": [*message.get("headers", []), (b"server-timing", value)]}
            await send(message)
        await app(scope, receive, timed)
    return middleware
