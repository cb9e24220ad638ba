"""The Anthropic dialect's error rendering and response wrapping at the ingress."""
from __future__ import annotations

import asyncio
import json

import pytest

from sluice.ingress.anthropic import MESSAGES
from sluice.ingress.dialects import OPENAI_CHAT
from sluice.ipc.messages import Failure
from sluice.schemas.errors import ANTHROPIC


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (405, "invalid_request_error"), (408, "invalid_request_error"),
    (413, "request_too_large"), (429, "rate_limit_error"), (500, "api_error"), (503, "overloaded_error"),
    (504, "timeout_error"), (529, "overloaded_error"),
])
def test_each_status_has_anthropics_error_type(status, kind):
    assert json.loads(ANTHROPIC.body(Failure(status, "why"))) == {"type": "error", "error": {"type": kind,
                                                                                         "message": "why"}}


def test_the_message_names_the_field_and_a_stream_says_it_as_an_event():
    assert json.loads(ANTHROPIC.body(Failure(400, "too big", param="max_tokens")))["error"]["message"] == \
        "max_tokens: too big"
    event = ANTHROPIC.stream(Failure(500, "the engine process died"), 0)
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")
    assert json.loads(event.split(b"data: ")[1])["error"]["type"] == "api_error"


def _sent(dialect, status: int) -> list[dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def respond() -> None:
        wrapped = dialect.wrap_send(send)
        await wrapped({"type": "http.response.start", "status": status, "headers": [(b"x", b"1")]})
        await wrapped({"type": "http.response.body", "body": b"{}"})

    asyncio.run(respond())
    return sent


def test_anthropic_responses_say_529_for_a_full_server_and_carry_a_request_id():
    start, body = _sent(MESSAGES, 503)
    assert start["status"] == 529 and start["headers"][0] == (b"x", b"1")
    assert start["headers"][1][0] == b"request-id" and start["headers"][1][1].startswith(b"req_")
    assert body == {"type": "http.response.body", "body": b"{}"}
    assert _sent(MESSAGES, 200)[0]["status"] == 200


def test_openai_responses_are_untouched():
    assert OPENAI_CHAT.wrap_send(print) is print
    assert _sent(OPENAI_CHAT, 503)[0] == {"type": "http.response.start", "status": 503, "headers": [(b"x", b"1")]}
