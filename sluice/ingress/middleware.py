"""--middleware: operators' ASGI middleware around the ingress app. Each is `module:factory` (an importable
module) or `path/to/file.py:factory`; the factory takes the ASGI app and returns the app that wraps it. The
first given is the outermost: it sees each request first and its response last. A middleware sees every
scope (lifespan too) and must pass on what it does not handle; what it puts in a request's scope (its
"state" included) reaches the app as it left it. deploy/middleware_example.py is an example."""
from __future__ import annotations

from typing import Any, Callable

from sluice.base import hooks

App = Callable[..., Any]  # an ASGI app: (scope, receive, send) -> awaitable


def load(spec: str, flag: str = "--middleware") -> Callable[[App], App]:
    """The factory `spec` names (ValueError, saying why, when it names none)."""
    factory = hooks.named(spec, flag)
    if not callable(factory):
        raise ValueError(f"{flag} {spec!r}: {spec.rpartition(':')[0]} has no callable {spec.rpartition(':')[2]!r}")
    return factory


def checked(spec: str) -> str:
    """`spec` once it loads (at startup, so that a typo fails the start rather than each ingress worker), with
    a file's path made absolute."""
    return hooks.checked(spec, "--middleware", load)


def wrapped(app: App, specs: list[str]) -> App:
    """`app` inside the middleware `specs` name, the first the outermost."""
    for spec in reversed(specs):
        app = load(spec)(app)
    return app
