"""What Anthropic's API refuses beyond the fields' types, /v1/messages and count_tokens refuse too: a 400 in
Anthropic's shape that says where (issue 37)."""
from __future__ import annotations

import anthropic
import httpx
import pytest

MODEL = "builtin:tiny-chat"
TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]}


def _result(tool_use_id: str) -> dict:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use_id, "content": "sunny"}]}


HI = {"role": "user", "content": "Hi"}


@pytest.mark.parametrize("body, words", [
    ({"messages": [{"role": "user", "content": ""}]}, "non-empty content"),
    ({"messages": [{"role": "user", "content": []}]}, "non-empty content"),
    ({"messages": [HI, USE, _result("nope")]}, "unexpected `tool_use_id`"),
    ({"messages": [_result("t1")]}, "unexpected `tool_use_id`"),  # no tool_use before it at all
    ({"messages": [HI], "tools": [TOOL, TOOL]}, "Tool names must be unique"),
    ({"messages": [HI], "tools": [dict(TOOL, name="get weather")]}, "should match pattern"),
    ({"messages": [HI], "tools": [dict(TOOL, name='say"hi')]}, "should match pattern"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "bogus"}}]}]},
     "cache_control"),
    ({"messages": [HI], "tools": [dict(TOOL, cache_control={"type": "bogus"})]}, "cache_control"),
])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_anthropics_own_refusals_are_400s_in_its_shape(server, path, body, words):
    r = httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 4, **body} if path == "/v1/messages"
                   else {"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert words in r.json()["error"]["message"] and len(r.json()["error"]["message"]) < 400


def test_what_anthropic_takes_is_still_taken(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    messages = [HI, USE, _result("t1")]
    cached = {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    got = client.messages.create(model=MODEL, max_tokens=2, messages=messages, tools=[TOOL], system=[cached])
    assert got.usage.output_tokens > 0
    assert client.messages.count_tokens(model=MODEL, messages=messages, tools=[TOOL]).input_tokens > 0
    with pytest.raises(anthropic.BadRequestError, match="Tool names must be unique"):
        client.messages.create(model=MODEL, max_tokens=2, messages=[HI], tools=[TOOL, TOOL])
