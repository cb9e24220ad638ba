"""The Responses framer fed fake engine steps through a postproc shard: its events, its body, and the
invariant that a stream, however its tokens are grouped into frames, assembles into the body."""
from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai._models import construct_type
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from tokenizers import Tokenizer

from sluice.ipc.messages import Frame
from sluice.postproc.worker import Shard
from sluice.schemas.responses import CreateResponse, FramerSpec, RenderBody, new_response
from tests.postproc.test_shard import feed, start

TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]


@pytest.fixture(scope="module")
def shard(tiny_chat_dir):
    """(Each request it is fed ends, and leaves nothing behind for the next.)"""
    return Shard(Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json")))


def _start(shard, stream: bool, background: bool = False, **request):
    r = msgspec.convert({"model": "m", "input": "Hi", "tools": TOOLS, **request}, CreateResponse)
    framing = FramerSpec(new_response(r, "", 0, "in_progress"), first_sequence_number=int(background))
    return start(shard, "resp_1", endpoint="responses", stream=stream, parsers=["think", "hermes"],
                 dialect=msgspec.msgpack.encode(framing))


def _output(text: str, calls=()) -> str:
    return text + "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>\n' for n, a in calls)


def _run(shard, text: str, stream: bool, groups=None, final="length", eos=True):
    eos_id = shard.tokenizer.token_to_id("<|im_end|>") if eos else None
    frames: list[Frame] = []
    data, _ = feed(shard, text, rid="resp_1", started=_start(shard, stream), final=final, eos=eos_id, groups=groups,
                   frames=frames)
    return framed_events(frames) if stream else json.loads(data[-1])


def framed_events(frames: list[Frame]) -> list[dict]:
    """Each event's data, cut out of its frame by the sizes the postproc gave (Frame.sizes: what the state
    store keeps, one row an event, nothing parsed back): they cover the whole frame, one event each, and its
    `event:` line names its type."""
    assert all(sum(f.sizes) == len(f.data) for f in frames)
    events = [e.decode() for f in frames for e in f.events()]
    assert all(e.endswith("\n\n") and e.count("\n\n") == 1 for e in events)
    heads = [e[:-2].split("\ndata: ", 1) for e in events]
    assert all(head == "event: " + json.loads(body)["type"] for head, body in heads)
    return [json.loads(body) for _, body in heads]


def _sdk_final(events: list[dict]):
    """What the openai SDK's responses.stream() helper assembles from the events."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
    return state._completed_response


def _without_ids(response: dict) -> dict:
    out = json.loads(json.dumps(response))
    for i, item in enumerate(out["output"]):
        item["id"] = i
        if "call_id" in item:
            item["call_id"] = i
    return out


def test_reasoning_text_and_a_call_become_three_items_and_the_usage_counts_reasoning(shard):
    body = _run(shard, _output("<think>Plan it.</think>Sure.", [("get_weather", {"city": "Paris"})]), stream=False)
    assert body["status"] == "completed" and body["id"] == "resp_1" and body["object"] == "response"
    reasoning, message, call = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "Plan it."}]
    assert message["content"][0]["text"] == "Sure." and message["status"] == "completed"
    assert (call["type"], call["name"], json.loads(call["arguments"])) == ("function_call", "get_weather",
                                                                            {"city": "Paris"})
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    usage = body["usage"]
    assert usage["input_tokens"] == 5 and usage["input_tokens_details"] == {"cached_tokens": 2}
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] < usage["output_tokens"]
    assert body["tools"][0]["name"] == "get_weather" and body["created_at"] == 1


def test_a_stream_tells_every_event_the_sdk_needs_numbered_in_order(shard):
    events = _run(shard, _output("<think>Plan.</think>Sure.", [("get_weather", {"city": "Paris"})]), stream=True)
    types = [e["type"] for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    for kind in ("reasoning_text", "output_text"):
        assert f"response.{kind}.delta" in types and f"response.{kind}.done" in types
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 3
    assert types[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = _sdk_final(events)
    assert final.output_text == "Sure." and final.output[2].name == "get_weather"


def test_the_cut_at_max_output_tokens_is_an_incomplete_response(shard):
    body = _run(shard, "Once upon a time", stream=False, eos=False)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"
    events = _run(shard, "Once upon a time", stream=True, eos=False)
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"


def test_a_background_stream_goes_on_from_its_stored_created_event(shard):
    frames: list[Frame] = []
    feed(shard, "Hi", rid="resp_1", started=_start(shard, True, background=True), final="length", frames=frames)
    events = framed_events(frames)
    assert events[0]["type"] == "response.in_progress" and events[0]["sequence_number"] == 1


_TEXT = st.text(alphabet="ab cé\n.,!", max_size=12)


@settings(max_examples=40, deadline=None)
@given(reasoning=_TEXT, content=_TEXT, calls=st.lists(st.tuples(st.sampled_from(["get_weather", "f"]),
                                                                st.dictionaries(st.sampled_from("xyz"), _TEXT,
                                                                                max_size=2)), max_size=2),
       groups=st.lists(st.integers(1, 6), max_size=8), eos=st.booleans())
def test_a_stream_assembles_into_the_body_for_any_grouping_of_its_tokens(shard, reasoning, content, calls, groups,
                                                                          eos):
    text = _output(f"<think>{reasoning}</think>{content}", calls)
    body = _run(shard, text, stream=False, eos=eos)
    events = _run(shard, text, stream=True, groups=groups, eos=eos)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert _without_ids(events[-1]["response"]) == _without_ids(body)
    items = {i: e["item"] for e in events if e["type"] == "response.output_item.done" for i in [e["output_index"]]}
    assert _without_ids({"output": [items[i] for i in sorted(items)]}) == {"output": _without_ids(body)["output"]}
    deltas: dict[int, str] = {}
    for e in events:
        if e["type"].endswith(".delta"):
            deltas[e["output_index"]] = deltas.get(e["output_index"], "") + e["delta"]
    for i, item in enumerate(body["output"]):
        whole = item.get("arguments") if item["type"] == "function_call" else item["content"][0]["text"]
        assert deltas.get(i, "") == whole
    if eos:  # (the SDK's helper takes the stream: it raises on an event out of place)
        assert [item.type for item in _sdk_final(events).output] == [item["type"] for item in body["output"]]
        assert [json.loads(i["arguments"]) for i in body["output"] if i["type"] == "function_call"] == [
            a for _, a in calls]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_with_nothing_but_whitespace_has_no_output_items(shard, stream):
    got = _run(shard, "  \n", stream=stream)
    body = got[-1]["response"] if stream else got
    assert body["output"] == [] and body["status"] == "completed"


@pytest.mark.parametrize("stream", [False, True])
def test_sealed_reasoning_and_a_namespace_call_as_codex_asks_for_them(shard, tmp_path, stream):
    """include reasoning.encrypted_content: each finished reasoning item carries its text sealed (not the item
    as added, which is not finished); a call to a namespace's function comes back under its own name with the
    namespace. The framing is the translation's, as the render worker makes it."""
    from sluice.base import sealing
    from sluice.render.responses import translate

    namespace = {"type": "namespace", "name": "weather", "description": "Weather", "tools": TOOLS}
    r = msgspec.convert({"model": "m", "input": "Hi", "tools": [namespace, {"type": "web_search"}], "store": False,
                         "include": ["reasoning.encrypted_content"]}, CreateResponse)
    framing = translate(msgspec.json.encode(RenderBody(r, state_dir=str(tmp_path)))).dialect
    started = start(shard, "resp_1", endpoint="responses", stream=stream, parsers=["think", "hermes"],
                    dialect=framing)
    text = _output("<think>Plan it.</think>", [("weather__get_weather", {"city": "Paris"})])
    frames: list[Frame] = []
    data, _ = feed(shard, text, rid="resp_1", started=started, eos=shard.tokenizer.token_to_id("<|im_end|>"),
                   frames=frames)
    body = framed_events(frames)[-1]["response"] if stream else json.loads(data[-1])
    reasoning, call = body["output"]
    assert sealing.sealer(str(tmp_path)).open(reasoning["encrypted_content"]) == "Plan it."
    assert (call["name"], call["namespace"]) == ("get_weather", "weather")
    assert body["warnings"][0]["param"] == "tools[1]" and body["tools"][1] == {"type": "web_search"}
    if stream:
        events = framed_events(frames)
        added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert "encrypted_content" not in added[0] and done[0] == reasoning
        final = _sdk_final(events)
        assert final.output[0].encrypted_content == reasoning["encrypted_content"]
        assert final.output[1].namespace == "weather"
