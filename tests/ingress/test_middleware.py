from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sluice.ingress.middleware import checked, load, wrapped

EXAMPLE = str(Path(__file__).resolve().parents[2] / "deploy" / "middleware_example.py")
seen: list[str] = []


def _tagging(tag: str):
    def factory(app):
        async def middleware(scope, receive, send):
            seen.append(tag)
            await app(scope, receive, send)
        return middleware
    return factory


first, second = _tagging("first"), _tagging("second")


async def _app(scope, receive, send):
    seen.append("app")
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": repr(scope.get("state")).encode()})


def _call(app, scope: dict) -> list[dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}
    asyncio.run(app(scope, receive, send))
    return sent


def test_middleware_wraps_in_the_order_given_the_first_outermost():
    seen.clear()
    app = wrapped(_app, [f"{__name__}:first", f"{__name__}:second"])
    _call(app, {"type": "http", "headers": []})
    assert seen == ["first", "second", "app"]


def test_the_example_tags_responses_and_keeps_the_state_already_there():
    app = wrapped(_app, [f"{EXAMPLE}:request_id", f"{EXAMPLE}:server_timing"])
    sent = _call(app, {"type": "http", "headers": [(b"x-request-id", b"abc")], "state": {"kept": 1}})
    headers = dict(sent[0]["headers"])
    assert headers[b"x-request-id"] == b"abc" and b'desc="abc"' in headers[b"server-timing"]
    assert sent[1]["body"] == repr({"kept": 1, "request_id": "abc"}).encode()


def test_lifespan_passes_through_the_example():
    seen.clear()
    _call(wrapped(_app, [f"{EXAMPLE}:request_id"]), {"type": "lifespan"})
    assert seen == ["app"]


@pytest.mark.parametrize("spec, why", [
    ("no_colon", "give module:name"),
    ("no_such_module_here:f", "cannot load"),
    (f"{EXAMPLE}:missing", "no callable 'missing'"),
    ("/nowhere/at/all.py:f", "cannot load"),
])
def test_a_bad_spec_says_why(spec, why):
    with pytest.raises(ValueError, match=why):
        load(spec)


def test_a_file_is_made_absolute_at_startup(monkeypatch):
    monkeypatch.chdir(Path(EXAMPLE).parents[1])
    assert checked("deploy/middleware_example.py:request_id") == f"{EXAMPLE}:request_id"
    assert checked(f"{__name__}:first") == f"{__name__}:first"
