from __future__ import annotations

import msgspec
import pytest

from ingress.http import authorized, validation_error
from ipc.openai import ChatCompletionRequest

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
