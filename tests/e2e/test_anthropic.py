"""The Anthropic Messages dialect end to end: the official SDK and raw HTTP against real servers, with
recorded outputs (the replay runner) for exact content: hermes / think text on builtin:tiny-chat, harmony on
builtin:tiny-gpt-oss."""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from bench.server import Server
from tests.harmony_outputs import harmony_tokens

MODEL = "builtin:tiny-chat"
KEY = "sk-test"
TOOLS = [{"name": "get_weather", "description": "Weather for a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
RECORDED = ('<think>Plan: call the tool.</think>Sure.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>\n')


def recording(tmp_path_factory, tiny_chat_dir, text: str) -> str:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json"))
    path = tmp_path_factory.mktemp("replay") / "out.jsonl"
    path.write_text(json.dumps(tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("<|im_end|>")]))
    return str(path)


@pytest.fixture(scope="module")
def chat(tmp_path_factory, tiny_chat_dir):
    """Every request gets RECORDED as its output."""
    s = Server("--runner", "replay", "--replay-file", recording(tmp_path_factory, tiny_chat_dir, RECORDED),
               "--reasoning-parser", "think", "--tool-parser", "hermes", "--api-key", KEY,
               "--max-request-bytes", "65536", "--state-dir", str(tmp_path_factory.mktemp("state")))
    yield s
    assert s.stop() == 0, s.output()


def client(server, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60, **kw)


def post(server, body: dict, path: str = "/v1/messages", key: str = KEY, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
                      timeout=60, **kw)


def sse(text: str) -> list[tuple[str, dict]]:
    out = []
    for raw in text.split("\n\n"):
        if raw.strip():
            name, data = raw.split("\n")
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def same(a: anthropic.types.Message, b: anthropic.types.Message) -> None:
    """Two answers to the same request: equal but for ids (of the message and of each call)."""
    da, db = a.to_dict(exclude_none=True), b.to_dict(exclude_none=True)
    for d in (da, db):
        d.pop("id")
        d["content"] = [{k: v for k, v in block.items() if k not in ("id", "parsed_output")} for block in d["content"]]
        d["usage"].pop("cache_read_input_tokens"), d["usage"].pop("input_tokens")  # (a cache hit the second time)
    assert da == db


def test_a_message_with_thinking_text_and_a_tool_call(chat):
    raw = client(chat).messages.with_raw_response.create(model=MODEL, max_tokens=200, tools=TOOLS, messages=ASK)
    assert raw.headers["request-id"].startswith("req_")
    m = raw.parse()
    assert m.id.startswith("msg_") and m.model == MODEL and m.role == "assistant"
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert (m.content[0].thinking, m.content[0].signature != "", m.content[1].text) == ("Plan: call the tool.", True,
                                                                                        "Sure.")
    call = m.content[2]
    assert (call.name, call.input, call.id.startswith("call_")) == ("get_weather", {"city": "Paris"}, True)
    assert (m.stop_reason, m.stop_sequence) == ("tool_use", None)
    assert m.usage.output_tokens > 0 and m.usage.input_tokens + m.usage.cache_read_input_tokens > 0


def test_the_stream_helper_assembles_the_message_create_returns(chat):
    c = client(chat)
    whole = c.messages.create(model=MODEL, max_tokens=200, tools=TOOLS, messages=ASK)
    with c.messages.stream(model=MODEL, max_tokens=200, tools=TOOLS, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert text == "Sure."
    same(streamed, whole)
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_a_multi_turn_tool_use_and_count_tokens_equal_to_the_prompt_the_engine_saw(chat):
    c = client(chat)
    first = c.messages.create(model=MODEL, max_tokens=200, tools=TOOLS, messages=ASK)
    call = first.content[2]
    turns = ASK + [{"role": "assistant", "content": [b.to_dict() for b in first.content]},
                   {"role": "user", "content": [
                       {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "sunny"}]},
                       {"type": "text", "text": "And tomorrow?"}]}]
    kw = dict(model=MODEL, tools=TOOLS, system=[{"type": "text", "text": "Be brief.", "cache_control":
                                                 {"type": "ephemeral"}}], messages=turns,
              tool_choice={"type": "tool", "name": "get_weather"})
    second = c.messages.create(max_tokens=200, metadata={"user_id": "u-1"}, **kw)
    assert second.stop_reason == "tool_use" and second.content[-1].type == "tool_use"
    counted = c.messages.count_tokens(**kw).input_tokens
    assert counted == second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert counted > first.usage.input_tokens + first.usage.cache_read_input_tokens
    errored = dict(turns[-1], content=[{"type": "tool_result", "tool_use_id": call.id, "content": "timeout",
                                        "is_error": True}])
    assert c.messages.count_tokens(**dict(kw, messages=turns[:-1] + [errored])).input_tokens > 0


def test_stop_sequences_and_max_tokens_say_why_the_message_ended(chat):
    c = client(chat)
    m = c.messages.create(model=MODEL, max_tokens=200, tools=TOOLS, messages=ASK, stop_sequences=["Nope", "Sure"])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "Sure")
    assert [(b.type, b.thinking) for b in m.content] == [("thinking", "Plan: call the tool.")]
    with c.messages.stream(model=MODEL, max_tokens=200, tools=TOOLS, messages=ASK, stop_sequences=["Sure"]) as s:
        same(s.get_final_message(), m)
    m = c.messages.create(model=MODEL, max_tokens=3, messages=ASK)
    assert (m.stop_reason, m.usage.output_tokens) == ("max_tokens", 3)


def test_beta_routes_omitted_thinking_and_the_openai_twin(chat):
    """The same tokens through both dialects: the one core's parsers, each dialect's shapes."""
    m = client(chat).beta.messages.create(model=MODEL, max_tokens=200, tools=TOOLS, messages=ASK,
                                          extra_body={"thinking": {"type": "adaptive", "display": "omitted"}})
    assert m.content[0].type == "thinking" and m.content[0].thinking == "" and m.content[0].signature
    o = openai.OpenAI(base_url=chat.url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=200, messages=ASK,
        tools=[{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}} for t in TOOLS])
    msg = o.choices[0].message
    assert (msg.content.strip(), msg.model_extra["reasoning_content"]) == (m.content[1].text, "Plan: call the tool.")
    assert json.loads(msg.tool_calls[0].function.arguments) == m.content[2].input


def test_a_raw_stream_is_anthropics_event_sequence(chat):
    r = post(chat, {"model": MODEL, "max_tokens": 200, "messages": ASK, "tools": TOOLS, "stream": True},
             params={"beta": "true"})
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
    names = [name for name, _ in sse(r.text)]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop") == 3


@pytest.mark.parametrize("body, status, kind, words", [
    ({"model": MODEL, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "frequency_penalty": 1}, 400, "invalid_request_error",
     "frequency_penalty"),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "temperature": 1.5}, 400, "invalid_request_error",
     "temperature"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, 400, "invalid_request_error", "image"),
    ({"model": "claude-nope", "max_tokens": 5, "messages": ASK}, 404, "not_found_error", "claude-nope"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 70000}]}, 413,
     "request_too_large", "larger"),
])
def test_bad_requests_get_anthropic_errors(chat, body, status, kind, words):
    r = post(chat, body)
    assert r.status_code == status and r.headers["request-id"].startswith("req_")
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and words in error["error"]["message"]


def test_auth_method_and_unknown_batch_errors(chat):
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=chat.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    assert post(chat, {}, key="").status_code == 401
    with pytest.raises(anthropic.NotFoundError):
        client(chat).messages.batches.retrieve("msgbatch_nope")
    r = httpx.get(chat.url + "/v1/messages", headers={"x-api-key": KEY})
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    bearer = httpx.post(chat.url + "/v1/messages", headers={"authorization": f"Bearer {KEY}"},
                        json={"model": MODEL, "max_tokens": 2, "messages": ASK})
    assert bearer.status_code == 200


def test_openai_routes_keep_openai_errors(chat):
    r = httpx.post(chat.url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "messages": ASK, "bogus": 1})
    assert r.status_code == 400 and set(r.json()) == {"error"} and "request-id" not in r.headers
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == "bogus"


def test_a_stream_goes_on_while_bad_requests_are_refused(chat):
    c = client(chat)
    with c.messages.stream(model=MODEL, max_tokens=200, tools=TOOLS, messages=ASK) as stream:
        next(iter(stream))
        for _ in range(3):
            assert post(chat, {"model": MODEL, "max_tokens": 0, "messages": ASK}).status_code == 400
        assert [b.type for b in stream.get_final_message().content] == ["thinking", "text", "tool_use"]


# ---- a slow engine: keepalives, a full server, deadlines ---------------------------------------------------

@pytest.fixture(scope="module")
def slow():
    s = Server("--runner", "replay", "--replay-step-ms", "1200", "--max-pending", "1", "--request-timeout", "2.5")
    yield s
    assert s.stop() == 0, s.output()


def test_pings_keep_a_waiting_stream_alive_then_the_deadline_is_an_error_event(slow):
    r = post(slow, {"model": MODEL, "max_tokens": 1, "messages": ASK, "stream": True})
    names = [name for name, _ in sse(r.text)]
    assert names[0] == "ping" and names[names.index("message_start"):][-2:] == ["message_delta", "message_stop"]
    r = post(slow, {"model": MODEL, "max_tokens": 8, "messages": ASK, "stream": True})
    events = sse(r.text)
    assert r.status_code == 200 and events[0][0] == "ping"
    assert events[-1] == ("error", {"type": "error", "error": {"type": "timeout_error", "message": events[-1][1][
        "error"]["message"]}}) and "2.5s" in events[-1][1]["error"]["message"]
    r = post(slow, {"model": MODEL, "max_tokens": 8, "messages": ASK})
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"


def test_a_full_server_is_overloaded_529_with_retry_after(slow):
    body = {"model": MODEL, "max_tokens": 1, "messages": ASK}
    with httpx.stream("POST", slow.url + "/v1/messages", json=dict(body, stream=True, max_tokens=3),
                      timeout=60) as busy:
        chunks = busy.iter_raw()  # (kept: a generator dropped would close the response)
        assert next(chunks).startswith(b"event: ping")  # it holds the one slot
        r = post(slow, body)
        assert r.status_code == 529 and r.headers["retry-after"] == "1" and r.headers["request-id"]
        assert r.json()["error"]["type"] == "overloaded_error"
        with pytest.raises(anthropic.InternalServerError) as e:  # (the SDK's OverloadedError, when it retries)
            client(slow).messages.create(**body)
        assert e.value.status_code == 529


# ---- gpt-oss: harmony through the same dialect -------------------------------------------------------------

REASONED = [("analysis", "The user wants weather."), ("final", "It is sunny in Paris.")]
CALLING = [("analysis", "I need the tool."), ("call", "get_weather", {"city": "Paris"})]


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "harmony.jsonl"
    path.write_text("\n".join(json.dumps(harmony_tokens(r)) for r in (CALLING, CALLING, REASONED)))
    s = Server("--model", "builtin:tiny-gpt-oss", "--max-model-len", "4096", "--runner", "replay",
               "--replay-file", str(path))
    yield s
    assert s.stop() == 0, s.output()


def test_recorded_harmony_outputs_through_the_sdk(harmony):
    """The recordings go to requests in arrival order: one test sends them in turn."""
    c = anthropic.Anthropic(base_url=harmony.url, api_key="x", max_retries=0, timeout=60)
    kw = dict(model="builtin:tiny-gpt-oss", max_tokens=200, tools=TOOLS, system="Be brief.", messages=ASK)
    m = c.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
    assert (m.content[0].thinking, m.content[1].name, m.content[1].input) == (
        "I need the tool.", "get_weather", {"city": "Paris"})
    with c.messages.stream(**kw) as stream:
        same(stream.get_final_message(), m)
    turns = ASK + [{"role": "assistant", "content": [b.to_dict() for b in m.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[1].id,
                                                 "content": "sunny"}]}]
    answer = c.messages.create(**dict(kw, messages=turns))
    assert [(b.type, getattr(b, "text", None)) for b in answer.content] == [
        ("thinking", None), ("text", "It is sunny in Paris.")]
    assert answer.stop_reason == "end_turn" and answer.content[0].thinking == "The user wants weather."
    counted = c.messages.count_tokens(**{k: v for k, v in dict(kw, messages=turns).items() if k != "max_tokens"})
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens


# ---- context editing and diagnostics (betas of the SDK's create call) --------------------------------------

def _history() -> list[dict]:
    """Two answered prompts: the first with a tool loop (thinking, a call, its long result, an answer)."""
    return ASK + [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Plan: call the tool for Paris.", "signature": "s"},
            {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny and warm " * 30}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "The tool said sunny.", "signature": "s"},
                                          {"type": "text", "text": "Sunny."}]},
        {"role": "user", "content": "And Rome?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Rome: I know it.", "signature": "s"},
                                          {"type": "text", "text": "Rainy."}]},
        {"role": "user", "content": "Thanks. Tomorrow?"}]


EDITS = {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}},
                   {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 0},
                    "keep": {"type": "tool_uses", "value": 0}}]}


def test_context_edits_clear_earlier_turns_and_say_so_in_the_body_and_the_stream(chat):
    c = client(chat).beta.messages
    kw = dict(model=MODEL, max_tokens=200, tools=TOOLS, messages=_history(), betas=["context-management-2025-06-27"])
    plain = c.create(**kw)
    edited = c.create(context_management=EDITS, **kw)
    assert plain.context_management is None
    thinking, tools = edited.context_management.applied_edits
    assert (thinking.type, thinking.cleared_thinking_turns) == ("clear_thinking_20251015", 1)
    assert (tools.type, tools.cleared_tool_uses) == ("clear_tool_uses_20250919", 1)
    assert tools.cleared_input_tokens > 30 and thinking.cleared_input_tokens > 0

    def prompt(m) -> int:
        return m.usage.input_tokens + m.usage.cache_read_input_tokens

    # the prompt the engine saw lost the thinking, and the result less its placeholder
    assert prompt(plain) - prompt(edited) > thinking.cleared_input_tokens
    with c.stream(context_management=EDITS, **kw) as stream:
        streamed = stream.get_final_message()  # (its context_management: the message_delta's)
    assert streamed.context_management == edited.context_management and prompt(streamed) == prompt(edited)
    kept = c.create(context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}, **kw)
    assert kept.context_management.applied_edits == [] and prompt(kept) == prompt(plain)
    counted = c.count_tokens(context_management=EDITS, **{k: v for k, v in kw.items() if k != "max_tokens"})
    assert (counted.input_tokens, counted.context_management.original_input_tokens) == (prompt(edited), prompt(plain))


@pytest.mark.parametrize("edit, words", [({"type": "clear_everything_20990101"}, "'clear_everything_20990101'"),
                                         ({"type": "compact_20260112"}, "compact_20260112: server-side compaction")])
def test_an_edit_this_server_does_not_run_is_a_400_naming_it(chat, edit, words):
    with pytest.raises(anthropic.BadRequestError) as e:
        client(chat).beta.messages.create(model=MODEL, max_tokens=20, messages=ASK,
                                          context_management={"edits": [edit]})
    assert words in e.value.message and "context_management.edits[0]" in e.value.message


def test_diagnostics_say_why_the_prefix_cache_could_not_be_reused(chat):
    c = client(chat).messages
    kw = dict(model=MODEL, max_tokens=200, system="Be brief.")
    first = c.create(messages=ASK, diagnostics={"previous_message_id": None}, **kw)
    assert first.diagnostics is None
    turns = ASK + [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And Rome?"}]
    appended = c.create(messages=turns, diagnostics={"previous_message_id": first.id}, **kw)
    assert appended.diagnostics is None
    changed = c.create(messages=turns, diagnostics={"previous_message_id": appended.id}, **dict(kw, system="Be long."))
    reason = changed.diagnostics.cache_miss_reason
    assert reason.type == "system_changed" and reason.cache_missed_input_tokens > 0
    unknown = c.create(messages=ASK, diagnostics={"previous_message_id": "msg_never"}, **kw)
    assert unknown.diagnostics.cache_miss_reason.type == "previous_message_not_found"
