"""The one policy for tools this server does not offer the model: left out with a warning and a log line, or
a 400 naming the tool under --strict-tools."""
from __future__ import annotations

import logging

import msgspec

from sluice.base.config import ServerConfig
from sluice.ingress import responses
from sluice.schemas.responses import CreateResponse

TOOLS = [{"type": "function", "name": "shell"}, {"type": "web_search"},
         {"type": "namespace", "name": "ns", "description": "", "tools": [{"type": "custom", "name": "patch"}]}]


def _request() -> CreateResponse:
    return msgspec.convert({"model": "m", "input": "Hi", "tools": TOOLS}, CreateResponse)


def test_strict_tools_refuses_the_first_tool_not_offered_naming_it():
    failure = responses._tools_left_out(ServerConfig(strict_tools=True), _request())
    assert failure is not None and (failure.status, failure.param) == (400, "tools[1]")
    assert "'web_search'" in failure.message and "--strict-tools" in failure.message


def test_otherwise_each_tool_type_left_out_is_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(responses, "_told", set())
    with caplog.at_level(logging.WARNING, "sluice.ingress"):
        for _ in range(3):
            assert responses._tools_left_out(ServerConfig(), _request()) is None
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and "tools[1] (type 'web_search')" in logged[0] and "tools[2].tools[0]" in logged[1]
