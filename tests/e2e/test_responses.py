"""The Responses API end to end, through the openai SDK and raw HTTP against real servers: recorded outputs
(think + hermes text on tiny-chat; harmony on tiny-gpt-oss) for exact content, random tokens for long
background work, and a stop and start on one state directory."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from bench.server import Server
from tests.e2e.conftest import MODEL
from tests.harmony_outputs import harmony_tokens

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
ASK = "Weather in Paris?"
RECORDED = ('<think>Plan: call the tool.</think>Sure.'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _plain(response) -> dict:
    """A response without what differs between two runs of the same output (ids, times, cache hits)."""
    out = response.model_dump(exclude_none=True)
    for key in ("id", "created_at", "background", "store"):
        out.pop(key, None)
    out["usage"].pop("input_tokens_details")
    for i, item in enumerate(out["output"]):
        item["id"] = i
        if "call_id" in item:
            item["call_id"] = i
    return out


def _wait(client, rid: str, until=("completed", "incomplete", "failed", "cancelled"), timeout=30.0):
    deadline = time.monotonic() + timeout
    while (r := client.responses.retrieve(rid)).status not in until:
        assert time.monotonic() < deadline, r.status
        time.sleep(0.05)
    return r


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, tiny_chat_dir):
    """Every request's output: reasoning, "Sure." and a call to get_weather."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json"))
    path = tmp_path_factory.mktemp("replay") / "text.jsonl"
    path.write_text(json.dumps(tok.encode(RECORDED, add_special_tokens=False).ids + [tok.token_to_id("<|im_end|>")]))
    s = Server("--runner", "replay", "--replay-file", str(path), "--reasoning-parser", "think", "--tool-parser",
               "hermes", "--state-dir", str(tmp_path_factory.mktemp("state")))
    yield s
    assert s.stop() == 0, s.output()


def test_a_response_holds_reasoning_a_message_and_a_call_and_its_stream_assembles_into_it(recorded):
    client = _client(recorded)
    r = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, instructions="Be brief.")
    assert r.status == "completed" and r.id.startswith("resp_") and r.instructions == "Be brief."
    reasoning, message, call = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Plan: call the tool."
    assert r.output_text == "Sure." and message.status == "completed"
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    assert client.responses.retrieve(r.id) == r
    with client.responses.stream(model=MODEL, input=ASK, tools=TOOLS, instructions="Be brief.") as stream:
        types = {event.type for event in stream}
        final = stream.get_final_response()
    assert types >= {"response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.reasoning_text.delta", "response.reasoning_text.done",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"}
    assert _plain(final) == _plain(r)
    assert client.responses.retrieve(final.id).output_text == "Sure."


def test_a_function_call_round_trip_by_previous_response_id_and_by_full_input(recorded):
    client = _client(recorded)
    first = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, instructions="Be brief.")
    call = first.output[-1]
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, input=[answer], tools=TOOLS,
                                      instructions="Be brief.")
    assert chained.previous_response_id == first.id and chained.status == "completed"
    assert chained.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens // 2
    assert chained.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16 > 0
    [item] = client.responses.input_items.list(chained.id)
    assert (item.type, item.call_id, item.output) == ("function_call_output", call.call_id, "sunny")
    whole = client.responses.create(model=MODEL, input=[{"role": "user", "content": ASK}, *first.output, answer],
                                    tools=TOOLS, instructions="Be brief.", store=False)
    assert whole.usage.input_tokens == chained.usage.input_tokens  # the same prompt, stored or sent
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)  # store: false keeps nothing


def test_input_items_page_and_a_deleted_response_is_gone(recorded):
    client = _client(recorded)
    r = client.responses.create(model=MODEL, input=[{"role": "user", "content": t} for t in ("a", "b", "c")],
                                max_output_tokens=4)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    pages = client.responses.input_items.list(r.id, limit=2, order="asc")
    assert [i.content[0].text for i in pages] == ["a", "b", "c"]  # (the SDK follows `after` to the next page)
    first = client.responses.input_items.list(r.id, limit=2)
    assert [i.content[0].text for i in first.data] == ["c", "b"] and first.has_more
    assert all(i.id.startswith("msg_") and i.type == "message" for i in pages)
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: client.responses.create(model=MODEL, input="x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()


@pytest.mark.parametrize("method, path, body, status, says", [
    ("POST", "/v1/responses", {"input": "x", "previous_response_id": "resp_nope"}, 404, "names no stored response"),
    ("POST", "/v1/responses", {"input": "x", "include": ["message.output_text.logprobs"]}, 400,
     "'message.output_text.logprobs' cannot be included"),
    ("POST", "/v1/responses", {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "v1.AAAA"}]}, 400,
     "input[0].encrypted_content is not reasoning this server sealed"),
    ("POST", "/v1/responses", {"input": [{"type": "computer_call_output"}]}, 400, "'computer_call_output'"),
    ("POST", "/v1/responses", {"input": "x", "model": "nope"}, 404, "does not exist"),
    ("POST", "/v1/responses", {"input": "x", "temperature": 9}, 400, "temperature"),
    ("GET", "/v1/responses/resp_nope", None, 404, "no response"),
    ("GET", "/v1/responses/resp_nope/input_items?limit=0", None, 400, "limit"),
    ("POST", "/v1/responses/resp_nope/cancel", None, 404, "no response"),
    ("PUT", "/v1/responses/resp_nope", None, 405, "use DELETE, GET"),
])
def test_each_error_is_in_the_openai_shape_with_its_status(recorded, method, path, body, status, says):
    r = httpx.request(method, recorded.url + path, json={"model": MODEL, **body} if body is not None else None)
    assert r.status_code == status and says in r.json()["error"]["message"], r.text


def test_a_foreground_response_can_be_neither_streamed_again_nor_cancelled(recorded):
    r = _client(recorded).responses.create(model=MODEL, input="x", max_output_tokens=2)
    for method, path in (("GET", f"/v1/responses/{r.id}?stream=true"), ("POST", f"/v1/responses/{r.id}/cancel")):
        got = httpx.request(method, recorded.url + path)
        assert got.status_code == 400 and "background" in got.json()["error"]["message"]


def test_a_background_response_is_queued_then_done_and_its_stream_resumes_from_any_event(recorded):
    client = _client(recorded)
    b = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, background=True)
    assert b.status == "queued" and b.background and b.output == []
    done = _wait(client, b.id)
    foreground = client.responses.create(model=MODEL, input=ASK, tools=TOOLS)
    assert done.status == "completed" and _plain(done) == _plain(foreground) and done.created_at == b.created_at
    events = list(client.responses.retrieve(b.id, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[0].response.status == "queued"
    assert events[1].type == "response.in_progress" and events[-1].type == "response.completed"
    later = list(client.responses.retrieve(b.id, stream=True, starting_after=4))
    assert [e.model_dump() for e in later] == [e.model_dump() for e in events[5:]]
    with client.responses.stream(response_id=b.id, starting_after=4) as stream:  # (the SDK skips them itself)
        assert [e.sequence_number for e in stream] == list(range(5, len(events)))
        assert _plain(stream.get_final_response()) == _plain(done)


def test_a_background_stream_outlives_the_client_that_left_it(recorded):
    client = _client(recorded)
    with client.responses.create(model=MODEL, input=ASK, background=True, stream=True) as stream:
        first = next(iter(stream))
    assert first.type == "response.created" and first.response.status == "queued"
    assert _wait(client, first.response.id).output_text == "Sure."


# ---- what Codex sends: sealed reasoning (store: false), namespace and hosted tools ---------------------

# Codex's tools: a function, a namespace (its function's flat name, get_ + weather, is the recordings' call) and
# web_search, which this server does not run (left out of the prompt, with a warning in the response).
CODEX_TOOLS = [{"type": "function", "name": "shell", "description": "Runs a command",
                "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}},
               {"type": "namespace", "name": "get_", "description": "Weather tools",
                "tools": [{**TOOLS[0], "name": "weather"}]},
               {"type": "web_search", "external_web_access": False}]


def _codex(client, model: str, input, stream: bool = False, **kw):
    """A request as `codex exec` sends it (streamed, as Codex does, where `stream`), its final response."""
    body = dict(model=model, input=input, instructions="You are Codex.", tools=CODEX_TOOLS, tool_choice="auto",
                parallel_tool_calls=True, store=False, include=["reasoning.encrypted_content"],
                reasoning={"summary": "auto"}, prompt_cache_key="session-1",
                extra_body={"client_metadata": {"x-codex-installation-id": "i"}}, **kw)
    if not stream:
        return client.responses.create(**body)
    with client.responses.stream(**body) as events:
        done = [e.item for e in events if e.type == "response.output_item.done"]
        final = events.get_final_response()
    sealed = [getattr(item, "encrypted_content", None) for item in done]  # (what Codex keeps: the done items)
    assert sealed == [getattr(item, "encrypted_content", None) for item in final.output]
    return final


def _check_codex_response(client, r, reasoning_text: str) -> None:
    assert r.store is False and [w["param"] for w in r.model_extra["warnings"]] == ["tools[2]"]
    assert "web_search" in r.model_extra["warnings"][0]["message"]
    reasoning = r.output[0]
    assert reasoning.content[0].text == reasoning_text and reasoning.encrypted_content.startswith("v1.")
    assert reasoning_text not in reasoning.encrypted_content
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def _sent_back(user: str, output, call_output: str, reasoning: bool = True) -> list[dict]:
    """The next request's input as Codex sends it: its items as they came, the reasoning by its sealed text
    alone, then the call's output."""
    items = [item.model_dump(exclude_none=True) for item in output]
    for item in items:
        item.pop("content", None) if item["type"] == "reasoning" else None
    items = [item for item in items if reasoning or item["type"] != "reasoning"]
    call = next(item for item in items if item["type"] == "function_call")
    return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": user}]}, *items,
            {"type": "function_call_output", "call_id": call["call_id"], "output": call_output}]


def test_codex_on_a_chat_template_model_gets_sealed_reasoning_back_and_continues_from_it(recorded):
    client = _client(recorded)
    first = _codex(client, MODEL, ASK, stream=True)
    _check_codex_response(client, first, "Plan: call the tool.")
    call = first.output[-1]
    assert (call.type, call.name, call.namespace, first.output_text) == ("function_call", "weather", "get_", "Sure.")
    sealed = _codex(client, MODEL, _sent_back(ASK, first.output, "sunny"))
    without = _codex(client, MODEL, _sent_back(ASK, first.output, "sunny", reasoning=False))
    plan = len(recorded_tokens("Plan: call the tool."))
    assert sealed.usage.input_tokens >= without.usage.input_tokens + plan  # (its <think> block was rendered)
    tampered = _sent_back(ASK, first.output, "sunny")
    tampered[1]["encrypted_content"] = tampered[1]["encrypted_content"][:-4] + "AAAA"
    with pytest.raises(openai.BadRequestError) as e:
        _codex(client, MODEL, tampered)
    assert e.value.body["param"] == "input[1].encrypted_content"


def recorded_tokens(text: str) -> list[int]:
    from tokenizers import Tokenizer

    from sluice.app.builtin_models import ensure_builtin

    return Tokenizer.from_file(str(ensure_builtin("tiny-chat") / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids


def test_text_format_json_schema_constrains_the_output_text(client):
    """The session's real tiny-chat model; store: false, so its state directory stays untouched."""
    r = client.responses.create(model=MODEL, input="One?", max_output_tokens=40, store=False, text={
        "format": {"type": "json_schema", "name": "one", "schema": {"const": 1}, "strict": True}})
    assert (r.output_text, r.status, r.text.format.type) == ("1", "completed", "json_schema")


# ---- long background work, cancelled or cut by a restart ------------------------

def _slow_server(state_dir, *flags: str) -> Server:
    """10 ms a token, the same ordinary token until max_output_tokens (random ones may hit a stop token)."""
    path = state_dir / "long.jsonl"
    path.write_text(json.dumps([1000] * 4000))
    return Server("--runner", "replay", "--replay-file", str(path), "--replay-step-ms", "10", "--state-dir",
                  str(state_dir), "--background-concurrency", "1", *flags)


@pytest.fixture(scope="module")
def slow_state(tmp_path_factory):
    return tmp_path_factory.mktemp("slow-state")


@pytest.fixture(scope="module")
def slow(slow_state):
    """The slow server with a 3 s deadline: the restart test's second start, then the cancel test's server."""
    s = _slow_server(slow_state, "--request-timeout", "3")
    yield s
    assert s.stop() == 0, s.output()


def test_a_restart_keeps_stored_responses_fails_what_it_cut_and_runs_what_was_queued(slow_state, request):
    """Before any test that starts `slow`: that start, on this state directory, is the restart."""
    server = _slow_server(slow_state)
    try:
        client = _client(server)
        kept = client.responses.create(model=MODEL, input="Remember this.", max_output_tokens=4)
        cut = client.responses.create(model=MODEL, input="go", max_output_tokens=3000, background=True)
        queued = client.responses.create(model=MODEL, input="go", max_output_tokens=3, background=True)
        _wait(client, cut.id, until=("in_progress",))
        assert client.responses.retrieve(queued.id).status == "queued"  # (one at a time)
    finally:
        assert server.stop() == 0, server.output()
    client = _client(request.getfixturevalue("slow"))
    failed = _wait(client, cut.id)
    assert failed.status == "failed" and failed.error.code == "server_restarted"
    assert _wait(client, queued.id).status == "incomplete"
    chained = client.responses.create(model=MODEL, input="And now?", previous_response_id=kept.id,
                                      max_output_tokens=2)
    assert chained.usage.input_tokens > kept.usage.input_tokens + kept.usage.output_tokens
    assert [i.content[0].text for i in client.responses.input_items.list(kept.id)] == ["Remember this."]


def test_cancel_stops_the_engine_work_is_idempotent_and_ends_the_stream(slow):
    client = _client(slow)
    b = client.responses.create(model=MODEL, input="go", max_output_tokens=3000, background=True)
    _wait(client, b.id, until=("in_progress",))
    assert client.responses.cancel(b.id).status == "cancelled"
    assert client.responses.cancel(b.id).status == "cancelled"
    deadline = time.monotonic() + 10
    while slow.metrics()["sluice:num_requests_running"] > 0:
        assert time.monotonic() < deadline, "the engine still runs the cancelled response"
        time.sleep(0.05)
    events = list(client.responses.retrieve(b.id, stream=True))
    assert events[-1].type == "error" and events[-1].code == "response_cancelled"
    assert client.responses.retrieve(b.id).status == "cancelled"
    quick = client.responses.create(model=MODEL, input="go", max_output_tokens=3, background=True)
    assert _wait(client, quick.id).status == "incomplete"  # the slot it held is free
    _a_stream_cut_by_its_deadline_ends_failed_and_stored(client)


def _a_stream_cut_by_its_deadline_ends_failed_and_stored(client):
    events = list(client.responses.create(model=MODEL, input="go", max_output_tokens=3000, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    error, failed = events[-2:]
    assert (error.type, error.code, failed.type) == ("error", "timeout", "response.failed")
    assert failed.response.error.code == "timeout" and failed.response.id == events[0].response.id
    assert client.responses.retrieve(failed.response.id).status == "failed"


# ---- gpt-oss: harmony recordings ------------------------------------------------

GPT_OSS = "builtin:tiny-gpt-oss"
REASONED = [("analysis", "The user wants weather."), ("final", "It is sunny in Paris.")]
CALLING = [("analysis", "I need the tool."), ("call", "get_weather", {"city": "Paris"})]


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "harmony.jsonl"
    path.write_text("\n".join(json.dumps(harmony_tokens(r)) for r in (REASONED, CALLING)))
    s = Server("--model", GPT_OSS, "--max-model-len", "4096", "--runner", "replay", "--replay-file", str(path),
               "--state-dir", str(tmp_path_factory.mktemp("state")))
    yield s
    assert s.stop() == 0, s.output()


def test_gpt_oss_reasoning_items_and_a_function_call_round_trip(harmony):
    """The recordings alternate (reasoned answer, call) in arrival order, so this one test sends in turn."""
    client = _client(harmony)
    kw = dict(model=GPT_OSS, tools=TOOLS, reasoning={"effort": "low"})
    r = client.responses.create(input=ASK, **kw)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "The user wants weather." and r.output_text == "It is sunny in Paris."
    assert r.usage.output_tokens_details.reasoning_tokens > 0 and r.reasoning.effort == "low"

    with client.responses.stream(input=ASK, **kw) as stream:
        types = [e.type for e in stream]
        calling = stream.get_final_response()
    assert "response.reasoning_text.delta" in types and "response.function_call_arguments.delta" in types
    reasoning, call = calling.output
    assert reasoning.content[0].text == "I need the tool." and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}

    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    chained = client.responses.create(input=[answer], previous_response_id=calling.id, **kw)
    assert chained.output_text == "It is sunny in Paris."
    assert chained.usage.input_tokens_details.cached_tokens >= calling.usage.input_tokens // 16 * 16 > 0
    whole = client.responses.create(input=[{"role": "user", "content": ASK}, *calling.output, answer], store=False,
                                    **kw)
    assert whole.usage.input_tokens == chained.usage.input_tokens


def test_codex_on_gpt_oss_gets_sealed_reasoning_back_and_harmony_renders_it_as_the_analysis(harmony):
    """Four requests, so the recordings' turns go on as they were (a reasoned answer, then a call)."""
    client = _client(harmony)
    answered = _codex(client, GPT_OSS, ASK, stream=True)
    _check_codex_response(client, answered, "The user wants weather.")
    calling = _codex(client, GPT_OSS, ASK)
    _check_codex_response(client, calling, "I need the tool.")
    call = calling.output[-1]
    assert (call.name, call.namespace, json.loads(call.arguments)) == ("weather", "get_", {"city": "Paris"})
    sealed = _codex(client, GPT_OSS, _sent_back(ASK, calling.output, "sunny"))
    without = _codex(client, GPT_OSS, _sent_back(ASK, calling.output, "sunny", reasoning=False))
    from sluice.base.harmony_vocab import harmony_encoding

    analysis = harmony_encoding().encode("<|channel|>analysis<|message|>I need the tool.<|end|>",
                                         allowed_special="all")
    # (the analysis message of the turn that called: harmony keeps it before the call's output)
    assert sealed.usage.input_tokens == without.usage.input_tokens + len(analysis) + 2  # (+ <|start|>assistant)


def test_truncation_auto_drops_the_oldest_turns_until_the_prompt_fits(client):
    """The session's server (store: false): seven turns, each as long beside its context as 12 repeats
    beside 256 tokens."""
    limit = client.models.list().data[0].model_extra["max_model_len"]
    turns = [{"role": role, "content": f"turn {i}: " + "words and more words " * (12 * limit // 256)}
             for i, role in enumerate(["user", "assistant"] * 3 + ["user"])]
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.responses.create(model=MODEL, input=turns, max_output_tokens=8, store=False)
    r = client.responses.create(model=MODEL, input=turns, max_output_tokens=8, store=False, truncation="auto")
    assert r.status in ("completed", "incomplete") and 0 < r.usage.input_tokens <= limit - 8
