"""The Responses API's translation into the chat core's request, and what its request Structs refuse."""
from __future__ import annotations

import re

import msgspec
import pytest

from sluice.render.responses import to_messages, translate
from sluice.render.truncation import without_oldest_turn
from sluice.schemas.openai import NamedToolChoice
from sluice.schemas.responses import CreateResponse, FramerSpec, InputItem, RenderBody

TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}


def _request(**fields) -> CreateResponse:
    return msgspec.convert({"model": "m", **fields}, CreateResponse)


def _translate(request: CreateResponse, **job):
    return translate(msgspec.json.encode(RenderBody(request, **job)))


def test_a_request_maps_onto_the_chat_request_field_by_field():
    t = _translate(_request(
        input="Weather in Paris?", instructions="Be brief.", tools=[TOOL], tool_choice={"type": "function",
                                                                                         "name": "get_weather"},
        parallel_tool_calls=False, max_output_tokens=64, temperature=0.5, top_p=0.9, reasoning={"effort": "low"},
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
        user="u1", metadata={"k": "v"}))
    chat = t.request
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "Weather in Paris?")]
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.parameters == {"type": "object"}
    assert isinstance(chat.tool_choice, NamedToolChoice) and chat.tool_choice.function.name == "get_weather"
    assert (chat.parallel_tool_calls, chat.max_completion_tokens, chat.temperature, chat.top_p) == (False, 64, 0.5, 0.9)
    assert chat.reasoning_effort == "low" and chat.user == "u1" and not chat.stream
    fmt = chat.response_format
    assert fmt.type == "json_schema" and fmt.json_schema.name == "w" and fmt.json_schema.strict
    framing = msgspec.msgpack.decode(t.dialect, type=FramerSpec)
    assert framing.response.metadata == {"k": "v"} and framing.first_sequence_number == 0 and not t.truncate


def test_a_background_job_streams_its_events_from_the_stored_first_one():
    t = _translate(_request(input="Hi", background=True), created_at=123, background=True)
    framing = msgspec.msgpack.decode(t.dialect, type=FramerSpec)
    assert t.request.stream and framing.first_sequence_number == 1 and framing.response.created_at == 123


def test_items_become_turns_and_the_stored_conversation_comes_first():
    items = msgspec.convert([
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Tools."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "noon"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny at noon."}]},
    ], list[InputItem])
    history, new = items[:4], items[4:]
    chat = _translate(_request(input=new, previous_response_id="resp_1"), history=history).request
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool", "tool", "assistant"]
    turn = chat.messages[1]
    assert turn.reasoning_content == "Tools." and turn.content is None
    assert [(c.id, c.function.name, c.function.arguments) for c in turn.tool_calls] == [
        ("c1", "get_weather", '{"city": "Paris"}'), ("c2", "get_time", "{}")]
    assert [(m.tool_call_id, m.name, m.content) for m in chat.messages[2:4]] == [
        ("c1", "get_weather", "sunny"), ("c2", "get_time", "noon")]
    assert chat.messages[4].content == "Sunny at noon."


def test_reasoning_after_a_call_begins_the_next_assistant_step():
    items = msgspec.convert([{"role": "user", "content": "Go"},
                             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                             {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Again."}]},
                             {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"}],
                            list[InputItem])
    messages = to_messages(None, items)
    assert [(m.role, m.reasoning_content, len(m.tool_calls or [])) for m in messages] == [
        ("user", None, 0), ("assistant", None, 1), ("assistant", "Again.", 1)]


def test_truncation_auto_drops_the_oldest_turn_and_keeps_the_instructions():
    items = msgspec.convert([{"role": "user", "content": "one"}, {"role": "assistant", "content": "1"},
                             {"role": "user", "content": "two"}, {"role": "assistant", "content": "2"},
                             {"role": "user", "content": "three"}], list[InputItem])
    t = _translate(_request(input=items, instructions="Count.", truncation="auto"))
    assert t.truncate  # (the rule, one turn at a time: render/truncation.py finds the fewest at once)
    shorter = without_oldest_turn(t.request)
    assert [m.content for m in shorter.messages] == ["Count.", "two", "2", "three"]
    assert [m.content for m in without_oldest_turn(shorter).messages] == ["Count.", "three"]
    assert without_oldest_turn(without_oldest_turn(shorter)) is None
    assert without_oldest_turn(_translate(_request(input="only")).request) is None


@pytest.mark.parametrize("fields, says", [
    ({"input": "x", "include": ["reasoning.encrypted_content", "message.output_text.logprobs"]},
     "include: 'message.output_text.logprobs' cannot be included: logprobs are not returned"),
    ({"input": "x", "include": ["web_search_call.action.sources"]}, "no web_search calls are made here"),
    ({"input": "x", "tools": [TOOL, {"type": "namespace", "name": "get", "description": "",
                                      "tools": [{"type": "function", "name": "_weather"}]}]},
     "tools[1].tools[0]: the model would know two functions as 'get_weather'"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "ns", "description": "", "tools": []}]},
     "a namespace tool needs tools"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity: only the model's own verbosity"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "'input_image'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "items of type 'item_reference'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "needs call_id"),
    ({"input": "x", "background": True, "store": False}, "background response is stored"),
    ({"input": ""}, "input is empty"),
    ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice names a function"),
    ({"input": "x", "conversation": "conv_1"}, "conversation: conversations are not kept"),
    ({"input": "x", "frobnicate": 1}, "unknown field `frobnicate`"),
])
def test_what_this_server_cannot_honour_is_refused_naming_it(fields, says):
    with pytest.raises(msgspec.ValidationError, match=re.escape(says)):
        msgspec.json.decode(msgspec.json.encode({"model": "m", **fields}), type=CreateResponse)
