from __future__ import annotations

import asyncio
import math

import msgspec
import pytest

from sluice.ingress.formats import BadMsgpack, accepts_msgpack, msgpack_as_json, msgpack_responses, sends_msgpack
from sluice.ingress.http import MAX_MESSAGE, MAX_PARAM, capped_failure, validation_error
from sluice.ipc.messages import Failure
from sluice.schemas.openai import ChatCompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "héllo"}], "max_tokens": 3, "temperature": 0.5,
        "logit_bias": {"5": -1.5}, "stop": ["a", "b"], "stream": False, "seed": None}


def test_a_msgpack_body_reads_as_the_same_json_body():
    assert msgspec.json.decode(msgpack_as_json(msgspec.msgpack.encode(CHAT))) == CHAT
    assert msgspec.json.decode(msgpack_as_json(msgspec.msgpack.encode(CHAT)), type=ChatCompletionRequest) == \
        msgspec.json.decode(msgspec.json.encode(CHAT), type=ChatCompletionRequest)


@pytest.mark.parametrize("value, what", [
    ({"model": "m", "temperature": math.nan}, "NaN or infinite"),
    ({"model": "m", "messages": [{"x": [1, 2, -math.inf]}]}, "NaN or infinite"),
    ({"model": "m", 1: 2}, "key that is not a string"),
    ({"model": "m", "messages": [{"content": b"bytes"}]}, "bin value"),
    ({"model": msgspec.msgpack.Ext(5, b"x")}, "extension type"),
    (math.nan, "NaN or infinite"),
])
def test_what_json_cannot_say_is_refused(value, what):
    with pytest.raises(BadMsgpack, match=what):
        msgpack_as_json(msgspec.msgpack.encode(value))


@pytest.mark.parametrize("body", [b"\xc1", b"\x81\xa5model", b"\x92\x01"])
def test_malformed_msgpack_is_refused(body):
    with pytest.raises(BadMsgpack):
        msgpack_as_json(body)


def test_a_deep_body_does_not_reach_the_recursion_limit_in_the_walk():
    deep: list = []
    for _ in range(400):
        deep = [deep]
    assert msgpack_as_json(msgspec.msgpack.encode({"x": deep})).startswith(b'{"x":[[[')


@pytest.mark.parametrize("headers, msgpack", [
    ([(b"content-type", b"application/msgpack")], True),
    ([(b"Content-Type", b"Application/X-Msgpack; charset=binary")], True),
    ([(b"content-type", b"application/json"), (b"x-trtllm-msgpack", b"1")], True),  # trtllm's orchestrator
    ([(b"content-type", b"application/json")], False),
    ([], False),
])
def test_which_bodies_are_msgpack(headers, msgpack):
    assert sends_msgpack(headers) is msgpack


@pytest.mark.parametrize("accept, msgpack", [
    (b"application/msgpack", True),
    (b"application/x-msgpack", True),
    (b"application/json, application/msgpack", False),
    (b"application/json;q=0.5, application/msgpack", True),
    (b"application/msgpack;q=0", False),
    (b"*/*", False),
    (None, False),
])
def test_which_clients_get_msgpack(accept, msgpack):
    assert accepts_msgpack([(b"accept", accept)] if accept else []) is msgpack


def _sent(messages: list[dict]) -> list[dict]:
    out: list[dict] = []

    async def send(message: dict) -> None:
        out.append(message)

    async def run() -> None:
        wrapped = msgpack_responses(send)
        for m in messages:
            await wrapped(m)
    asyncio.run(run())
    return out


def test_a_whole_json_response_goes_as_msgpack():
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    out = _sent([start, {"type": "http.response.body", "body": b'{"a": [1,', "more_body": True},
                 {"type": "http.response.body", "body": b' "x"]}'}])
    assert out[0]["headers"] == [(b"content-type", b"application/msgpack")] and out[0]["status"] == 200
    assert msgspec.msgpack.decode(out[1]["body"]) == {"a": [1, "x"]} and len(out) == 2


def test_a_stream_goes_as_it_is():
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    chunk = {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}
    assert _sent([start, chunk]) == [start, chunk]


def test_validation_messages_are_capped():
    name = "x" * 1_000_000
    with pytest.raises(msgspec.MsgspecError) as e:
        msgspec.json.decode(msgspec.json.encode({**CHAT, name: 1}), type=ChatCompletionRequest)
    message, param = validation_error(e.value)
    assert len(message) <= MAX_MESSAGE and param is not None and len(param) <= MAX_PARAM
    assert "more characters" in message


def test_a_failure_that_echoes_input_is_capped():
    failure = capped_failure(Failure(404, "no model " + "m" * 100_000, param="p" * 100_000))
    assert len(failure.message) + len(failure.param or "") + 2 <= MAX_MESSAGE
    assert capped_failure(Failure(400, "short", param="x")) == Failure(400, "short", param="x")


@pytest.mark.parametrize("size", [1, 1_000, 10**6])
def test_an_echoed_value_is_cut_in_the_middle_to_a_few_hundred_characters(size):
    """(Issue 37: a client error's message is under a few hundred characters; what it says after the value it
    echoes stays, and the count of what was left out is exact.)"""
    text = "The model '" + "m" * size + "' does not exist; this server serves ['builtin:tiny-chat']"
    message = capped_failure(Failure(404, text, "model_not_found", "model")).message
    assert MAX_MESSAGE <= 512 and len(message) <= MAX_MESSAGE - len("model") - 2
    if size == 1:
        assert message == text
        return
    head, rest = message.split(" ...(")
    count, tail = rest.split(" more characters)... ")
    assert text.startswith(head) and text.endswith(tail) and len(head) + int(count) + len(tail) == len(text)
    assert tail.endswith("' does not exist; this server serves ['builtin:tiny-chat']")
