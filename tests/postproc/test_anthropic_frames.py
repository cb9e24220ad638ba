"""The Anthropic framer in a postproc shard fed fake engine steps: whole messages, streams, and the official
SDK's assembly of a stream, which must be the whole message whatever the grouping of the tokens."""
from __future__ import annotations

import importlib
import json

import anthropic
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from sluice.ipc.messages import PostprocSpec, Started
from sluice.postproc.stop import StopStrings
from sluice.postproc.worker import Shard
from sluice.schemas.anthropic import (CacheMiss, ClearedThinking, ClearedToolUses, ContextManagementResponse,
                                      Diagnostics, Framing)
from tests.postproc.test_shard import feed

TOOLS_OUTPUT = '<think>Plan: call the tool.</think>Sure.\n<tool_call>\n{"name": "get_weather", "arguments": ' \
               '{"city": "Paris"}}\n</tool_call>\n'


@pytest.fixture(scope="module")
def shard(tiny_chat_dir):
    return Shard(Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json")))


def _started(rid: str, stream: bool, stop=(), omit_thinking=False, framing: Framing | None = None) -> Started:
    spec = PostprocSpec(request_id=rid, endpoint="messages", model="m", created=1, reply_to="ipc://r", stream=stream,
                        stop=list(stop), parsers=["think", "hermes"],
                        dialect=msgspec.msgpack.encode(framing or Framing(omit_thinking=omit_thinking)))
    return Started(rid, msgspec.msgpack.encode(spec), num_prompt_tokens=7, num_cached_tokens=4)


def run(shard, text: str, stream: bool, groups=None, eos=True, **spec) -> list[bytes]:
    eos_id = shard.tokenizer.token_to_id("<|im_end|>") if eos else None
    data, _ = feed(shard, text, rid="msg_1", started=_started("msg_1", stream, **spec), eos=eos_id, groups=groups)
    return data


def events(data: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for raw in b"".join(data).decode().split("\n\n"):
        if raw:
            name, payload = raw.split("\n")
            assert name.startswith("event: ") and payload.startswith("data: ")
            out.append((name[7:], json.loads(payload[6:])))
    return out


def assembled(data: list[bytes]) -> dict:
    """The message the SDK's messages.stream() builds from these events."""
    for name, event in events(data):
        assert name == event["type"]
    with _sdk(b"".join(data), "text/event-stream").messages.stream(**_ASK) as stream:
        return _comparable(stream.get_final_message().to_dict(exclude_none=True))


def whole(data: list[bytes]) -> dict:
    """The message the SDK's messages.create() returns for this body."""
    assert len(data) == 1
    return _comparable(_sdk(data[0], "application/json").messages.create(**_ASK).to_dict(exclude_none=True))


_ASK = dict(model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}])
# the HTTP library the SDK is built on (httpx, or its successor httpx2 in recent releases)
_HTTPX = importlib.import_module(anthropic.DefaultHttpxClient.__mro__[1].__module__.split(".")[0])


def _sdk(body: bytes, content_type: str) -> anthropic.Anthropic:
    """The official client, answered with `body` whatever it asks."""
    transport = _HTTPX.MockTransport(lambda request: _HTTPX.Response(200, content=body,
                                                                     headers={"content-type": content_type}))
    return anthropic.Anthropic(api_key="x", base_url="http://sluice.test", max_retries=0,
                               http_client=anthropic.DefaultHttpxClient(transport=transport))


def _comparable(message: dict) -> dict:
    for block in message["content"]:
        if block["type"] == "tool_use":  # (the parser draws a fresh id for each run)
            block["id"] = "call"
    return message


def test_thinking_text_and_a_tool_call_make_three_blocks(shard):
    message = json.loads(run(shard, TOOLS_OUTPUT, stream=False)[0])
    assert message["content"][:2] == [
        {"type": "thinking", "thinking": "Plan: call the tool.", "signature": message["content"][0]["signature"]},
        {"type": "text", "text": "Sure."}]
    call = message["content"][2]
    assert (call["type"], call["name"], call["input"]) == ("tool_use", "get_weather", {"city": "Paris"})
    assert call["id"].startswith("call_") and message["content"][0]["signature"]
    assert (message["id"], message["type"], message["role"], message["model"]) == ("msg_1", "message", "assistant", "m")
    assert (message["stop_reason"], message["stop_sequence"]) == ("tool_use", None)
    n = len(shard.tokenizer.encode(TOOLS_OUTPUT, add_special_tokens=False).ids) + 1
    assert message["usage"] == {"input_tokens": 3, "cache_read_input_tokens": 4, "cache_creation_input_tokens": 0,
                                "output_tokens": n, "service_tier": "standard"}


def test_a_stream_is_a_well_formed_event_sequence(shard):
    got = events(run(shard, TOOLS_OUTPUT, stream=True))
    names = [name for name, _ in got]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert got[0][1]["message"]["content"] == [] and got[0][1]["message"]["stop_reason"] is None
    starts = [e["index"] for name, e in got if name == "content_block_start"]
    stops = [e["index"] for name, e in got if name == "content_block_stop"]
    assert starts == stops == [0, 1, 2]
    opened = None  # blocks follow one another: every delta goes to the block open now
    for name, e in got:
        if name == "content_block_start":
            opened = e["index"]
        elif name == "content_block_delta":
            assert e["index"] == opened
    kinds = [e["delta"]["type"] for name, e in got if name == "content_block_delta"]
    assert kinds == ["thinking_delta"] * kinds.count("thinking_delta") + ["signature_delta"] + \
        ["text_delta"] * kinds.count("text_delta") + ["input_json_delta"]
    delta = got[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == json.loads(run(shard, TOOLS_OUTPUT, False)[0])["usage"]["output_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_is_the_stop_sequence(shard, stream):
    data = run(shard, "Hello there END and more", stream, eos=False, stop=["XYZ", "END"])
    message = assembled(data) if stream else whole(data)
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")
    assert message["content"] == [{"type": "text", "text": "Hello there "}]


@pytest.mark.parametrize("stream", [False, True])
def test_the_cut_at_max_tokens_and_a_plain_end(shard, stream):
    for eos, reason in ((False, "max_tokens"), (True, "end_turn")):
        data = run(shard, "Once upon a time", stream, eos=eos)
        message = assembled(data) if stream else whole(data)
        assert (message["stop_reason"], message["content"]) == (reason, [{"type": "text", "text": "Once upon a time"}])


@pytest.mark.parametrize("stream", [False, True])
def test_arguments_that_are_no_json_object_give_an_empty_input(shard, stream):
    data = run(shard, '<tool_call>{"name": "f", "arguments": "city=Paris"}</tool_call>', stream)
    message = assembled(data) if stream else whole(data)
    assert [(b["type"], b["name"], b["input"]) for b in message["content"]] == [("tool_use", "f", {})]


@pytest.mark.parametrize("stream", [False, True])
def test_omitted_thinking_keeps_its_block_and_signature_only(shard, stream):
    data = run(shard, TOOLS_OUTPUT, stream, omit_thinking=True)
    message = assembled(data) if stream else whole(data)
    assert message["content"][0]["type"] == "thinking" and message["content"][0]["thinking"] == ""
    assert message["content"][0]["signature"] and message["content"][1] == {"type": "text", "text": "Sure."}


def test_what_the_edits_cleared_and_the_diagnosis_reach_the_body_and_the_stream(shard):
    framing = Framing(context_management=ContextManagementResponse([ClearedThinking(2, 30), ClearedToolUses(1, 9)]),
                      diagnostics=Diagnostics(CacheMiss("system_changed", 12)))
    whole = json.loads(b"".join(run(shard, "Hi.", False, framing=framing)))
    assert whole["context_management"] == {"applied_edits": [
        {"type": "clear_thinking_20251015", "cleared_thinking_turns": 2, "cleared_input_tokens": 30},
        {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 1, "cleared_input_tokens": 9}]}
    assert whole["diagnostics"] == {"cache_miss_reason": {"type": "system_changed", "cache_missed_input_tokens": 12}}
    streamed = dict(events(run(shard, "Hi.", True, framing=framing)))
    start, delta = streamed["message_start"]["message"], streamed["message_delta"]
    assert start["diagnostics"] == whole["diagnostics"] and start["context_management"] is None
    assert delta["context_management"] == whole["context_management"]
    plain = json.loads(b"".join(run(shard, "Hi.", False)))
    assert plain["context_management"] is None and plain["diagnostics"] is None
    assert "context_management" not in dict(events(run(shard, "Hi.", True)))["message_delta"]


def test_whitespace_between_and_after_calls_makes_no_text_blocks(shard):
    call = '<tool_call>\n{"name": "f", "arguments": {"a": %d}}\n</tool_call>'
    message = whole(run(shard, f"Two calls:\n\n{call % 1}\n{call % 2}\n", stream=False))
    assert [b["type"] for b in message["content"]] == ["text", "tool_use", "tool_use"]
    assert message["content"][0]["text"] == "Two calls:" and message["content"][2]["input"] == {"a": 2}


_words = st.text(st.sampled_from("ab é\n{}\":"), max_size=12)
_segment = st.one_of(
    st.builds("<think>{}</think>".format, _words),
    _words,
    st.builds(lambda name, args: '<tool_call>\n%s\n</tool_call>' % json.dumps({"name": name, "arguments": args}),
              st.sampled_from(["f", "get_weather"]),
              st.dictionaries(st.sampled_from("xyz"), st.integers() | _words, max_size=2)))


@settings(max_examples=80, deadline=None)
@given(segments=st.lists(_segment, max_size=6), groups=st.lists(st.integers(1, 40), max_size=10), eos=st.booleans())
def test_the_sdk_assembles_a_stream_into_the_whole_message_for_any_grouping(shard, segments, groups, eos):
    """Thinking, text and tool calls in any order and number, the tokens in steps of any size."""
    text = "".join(segments)
    eos = eos or not text  # (at least one token)
    assert assembled(run(shard, text, True, groups, eos)) == whole(run(shard, text, False, eos=eos))


@pytest.mark.parametrize("stops, chunks, matched", [
    (["abc", "b"], ["a", "b"], "b"),  # the first to complete, as a token-by-token stream sees it
    (["END", "ENDING"], ["the EN", "DING"], "END"),
    (["xyz"], ["no stop here"], None),
])
def test_stop_strings_say_which_one_ended_the_text(stops, chunks, matched):
    s = StopStrings(stops)
    for chunk in chunks:
        s.feed(chunk)
    assert s.matched == matched and s.stopped == (matched is not None)
