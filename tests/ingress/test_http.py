from __future__ import annotations

import asyncio

import msgspec
import pytest

from sluice.base.auth import authorized
from sluice.ingress.http import BodyTimedOut, BodyTooLarge, read_body, validation_error
from sluice.schemas.openai import ChatCompletionRequest

KEYS = [b"k1", b"k2"]


@pytest.mark.parametrize("path, header, protect, ok", [
    ("/v1/models", None, False, False),
    ("/v1/models", b"Bearer k2", False, True),
    ("/v1/models", b"bearer k1", False, True),
    ("/v1/models", b"Bearer k3", False, False),
    ("/v1/models", b"k1", False, False),
    ("/metrics", None, False, True),
    ("/metrics", None, True, False),
    ("/health", b"Bearer k1", True, True),
])
def test_authorized(path, header, protect, ok):
    headers = [(b"authorization", header)] if header else []
    assert authorized(path, headers, KEYS, protect) is ok
    assert authorized(path, headers, [], protect)  # no keys: everything is open


@pytest.mark.parametrize("body, param", [
    (b'{"model": "m", "messages": [], "bogus": 1}', "messages"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "bogus": 1}', "bogus"),
    (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
    (b'{"model": "m", "messages": [{"role": "x"}]}', "messages[0].role"),
    (b'{"model": ', None),
])
def test_validation_errors_name_the_field(body, param):
    with pytest.raises(msgspec.MsgspecError) as e:
        msgspec.json.decode(body, type=ChatCompletionRequest)
    message, got = validation_error(e.value)
    assert message and got == param


def receiver(chunks: list[bytes], then_stall: bool = False):
    """An ASGI receive that hands out `chunks` (the last one final unless it stalls after them)."""
    messages = [{"type": "http.request", "body": c, "more_body": then_stall or i < len(chunks) - 1}
                for i, c in enumerate(chunks)]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)  # a client that sent part of its body and then nothing

    return receive


def test_a_body_in_pieces_is_joined():
    assert asyncio.run(read_body(receiver([b"ab", b"", b"cd"]), 10, 1.0)) == b"abcd"
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(receiver([b"abcdef", b"ghijkl"]), 10, 1.0))


def test_a_body_that_stops_coming_times_out():
    # (the raise is the proof: the stalled client would hold the read for an hour)
    with pytest.raises(BodyTimedOut):
        asyncio.run(read_body(receiver([b'{"model": '], then_stall=True), 1 << 20, 0.2))
