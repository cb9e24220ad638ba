"""Routes beyond the generation ones: a handler per (method, path template). Modules register theirs with
`@route`; the ingress matches a request's path against the templates (`{name}` takes one path segment)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qsl

from sluice.ingress.dialects import Dialect

_INTEGER = re.compile(r"-?[0-9]{1,20}")  # (ASCII digits: str.isdigit takes '²', which int() refuses)


@dataclass(frozen=True)
class Request:
    """What a handler gets besides receive and send."""

    scope: dict
    params: dict[str, str]  # the template's {names}

    @property
    def query(self) -> dict[str, str]:
        return dict(parse_qsl(self.scope.get("query_string", b"").decode("latin-1")))

    def integer(self, name: str, default: int, low: int, high: int) -> int | None:
        """The query's `name` as an integer from `low` to `high` (`default` when it is absent); None when it is
        not one (the route answers 400 naming it). Bounded here, since past the route an integer meets SQLite
        (int64) or numpy, where one out of range is a crash, not a 400."""
        text = self.query.get(name)
        if text is None:
            return default
        if not _INTEGER.fullmatch(text):
            return None
        value = int(text)
        return value if low <= value <= high else None

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.scope["headers"] if k.lower() == name), None)


Handler = Callable[[Any, Request, Any, Any], Awaitable[int]]  # (ingress, request, receive, send) -> status


@dataclass(frozen=True)
class Route:
    method: str
    template: str  # e.g. /v1/responses/{id}; also its requests_total label
    handler: Handler
    dialect: Dialect | None = None  # whose shape its errors take (auth included); None: OpenAI's

    def match(self, path: str) -> dict[str, str] | None:
        want, got = self.template.strip("/").split("/"), path.strip("/").split("/")
        if want[-1].endswith(":path}"):  # the last one takes the rest (an id with '/')
            want[-1] = want[-1].replace(":path}", "}")
            got = got[:len(want) - 1] + ["/".join(got[len(want) - 1:])]
        if len(want) != len(got):
            return None
        params = {}
        for w, g in zip(want, got):
            if w.startswith("{") and w.endswith("}"):
                if not g:
                    return None
                params[w[1:-1]] = g
            elif w != g:
                return None
        return params


ROUTES: list[Route] = []


def route(method: str, template: str, dialect: Dialect | None = None) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        ROUTES.append(Route(method, template, handler, dialect))
        return handler
    return register


def find(path: str) -> list[tuple[Route, dict[str, str]]]:
    """Every route whose template matches `path` (one per method)."""
    return [(r, params) for r in ROUTES if (params := r.match(path)) is not None]
