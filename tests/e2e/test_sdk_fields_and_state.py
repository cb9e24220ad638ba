"""Today's clients and a state directory that goes away, on one real server (issue 37): every parameter of the
official SDKs' create calls sent as null is unset; the values frameworks send by default are taken, and
echoed where the real APIs echo them; what this server cannot honour is a 400 naming the field; an integer out
of range in a query string is a 400; and with the state database pulled away mid-run, every route of batches
and responses and stored chat completions answers an error in its dialect's shape (the last test: it breaks the
server's state)."""
from __future__ import annotations

import inspect
import time
from typing import Callable

import anthropic
import httpx
import openai
import pytest
from anthropic.resources.beta.messages import Messages as BetaMessages
from anthropic.resources.messages import Messages
from openai.resources.chat.completions import Completions as ChatCompletions
from openai.resources.completions import Completions
from openai.resources.responses import Responses

import bench.faults
from sluice.schemas import sdk_fields
from tests.e2e.test_batches import serve

MODEL = "builtin:tiny-chat"
USER = [{"role": "user", "content": "Hello"}]
CLAUDE_CODE_BETAS = ["context-management-2025-06-27", "interleaved-thinking-2025-05-14",
                     "prompt-caching-scope-2026-01-05", "mid-conversation-system-2026-04-07", "effort-2025-11-24"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_chat_dir):
    state = tmp_path_factory.mktemp("state")
    s = serve(tmp_path_factory, tiny_chat_dir, state)
    yield s, state
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def oc(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ac(served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served[0].url, api_key="x", max_retries=0, timeout=60)


def _nulls(method: Callable, table: sdk_fields.Table, *given: str) -> dict:
    """Every body parameter of an SDK call but those `given`, as null: in extra_body, which the SDK sends as
    it is (some calls of it cannot take None itself for every parameter)."""
    return {"extra_body": {p: None for p in inspect.signature(method).parameters
                           if p != "self" and p not in given and table[p].kind != "client"}}


def test_every_sdk_parameter_sent_as_null_is_unset(oc, ac):
    chat = oc.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=4, **_nulls(
        ChatCompletions.create, sdk_fields.CHAT_COMPLETIONS, "model", "messages", "max_completion_tokens"))
    assert chat.choices[0].message.content
    done = oc.completions.create(model=MODEL, prompt="Hello", max_tokens=4, **_nulls(
        Completions.create, sdk_fields.COMPLETIONS, "model", "prompt", "max_tokens"))
    assert done.choices[0].text
    response = oc.responses.create(model=MODEL, input="Hello", max_output_tokens=4, **_nulls(
        Responses.create, sdk_fields.RESPONSES, "model", "input", "max_output_tokens"))
    assert response.status in ("completed", "incomplete") and response.output
    given = ("model", "messages", "max_tokens")
    for method, create in ((Messages.create, ac.messages.create), (BetaMessages.create, ac.beta.messages.create)):
        message = create(model=MODEL, messages=USER, max_tokens=4, **_nulls(method, sdk_fields.MESSAGES, *given))
        assert message.content[0].text
    for method, count in ((Messages.count_tokens, ac.messages.count_tokens),
                          (BetaMessages.count_tokens, ac.beta.messages.count_tokens)):
        assert count(model=MODEL, messages=USER, **_nulls(method, sdk_fields.COUNT_TOKENS, *given)).input_tokens
    params = {"model": MODEL, "messages": USER, "max_tokens": 4,
              **_nulls(BetaMessages.create, sdk_fields.MESSAGES, *given)["extra_body"]}
    batch = ac.messages.batches.create(requests=[{"custom_id": "nulls", "params": params}])
    assert batch.processing_status == "in_progress"


def test_the_values_frameworks_send_by_default_are_taken_and_echoed(oc, ac):
    chat = oc.chat.completions.create(
        model=MODEL, messages=USER, max_completion_tokens=4, store=False, metadata={"app": "sluice-test"},
        service_tier="auto", prompt_cache_key="thread-1", prompt_cache_retention="24h", safety_identifier="u-1",
        prediction={"type": "content", "content": "Hello"}, modalities=["text"], verbosity="medium")
    assert chat.choices[0].message.content and chat.service_tier == "default"  # (the tier it was served on)
    chunks = list(oc.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=4, stream=True,
                                             stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].usage.completion_tokens > 0 and all(c.service_tier is None for c in chunks)  # (none asked)
    tiered = list(oc.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=4, stream=True,
                                             service_tier="flex"))
    assert {c.service_tier for c in tiered} == {"default"}
    response = oc.responses.create(
        model=MODEL, input="Hello", max_output_tokens=4, store=False, metadata={"app": "sluice-test"},
        service_tier="auto", prompt_cache_key="thread-1", safety_identifier="u-1", include=[],
        background_options={"completion_window": "soonest"})
    assert response.metadata == {"app": "sluice-test"} and response.service_tier == "default"
    assert response.prompt_cache_key == "thread-1" and response.safety_identifier == "u-1"
    # Claude Code's first request, as its current release sends it
    message = ac.beta.messages.create(
        model=MODEL, messages=USER, max_tokens=4, betas=CLAUDE_CODE_BETAS, thinking={"type": "adaptive"},
        output_config={"effort": "high"}, metadata={"user_id": "u-1"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]})
    assert message.content and message.usage.service_tier == "standard"


def test_what_this_server_cannot_honour_is_a_400_naming_the_field(oc, ac):
    for fields, param in (({"audio": {"voice": "alloy", "format": "mp3"}, "modalities": ["text", "audio"]}, "audio"),
                          ({"web_search_options": {}}, "web_search_options")):
        with pytest.raises(openai.BadRequestError) as e:
            oc.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=4, **fields)
        assert e.value.param == param and sdk_fields.CHAT_COMPLETIONS[param].note in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.beta.messages.create(model=MODEL, messages=USER, max_tokens=4, context_management={
            "edits": [{"type": "compact_20260112"}]})
    assert "context_management" in e.value.message and e.value.body["error"]["type"] == "invalid_request_error"


def test_a_stored_chat_completion_is_kept_listed_updated_and_deleted(oc):
    """store: true keeps the completion as answered (a stream's too: the whole body the postproc built), its
    request's messages and metadata; OpenAI's routes list, filter, page, update and delete them."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "Hello"}]}]
    made = oc.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=4, store=True,
                                      metadata={"app": "sluice-test", "run": "1"})
    stream = oc.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=4, store=True,
                                        metadata={"app": "sluice-test", "run": "2"}, stream=True,
                                        stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = chunks[0].id
    unstored = oc.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=4).id
    kept = oc.chat.completions.retrieve(made.id)
    assert kept.choices[0].message.content == made.choices[0].message.content and kept.usage == made.usage
    assert kept.metadata == {"app": "sluice-test", "run": "1"}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    again = oc.chat.completions.retrieve(streamed)
    assert again.choices[0].message.content == text and again.usage == chunks[-1].usage
    with pytest.raises(openai.NotFoundError):
        oc.chat.completions.retrieve(unstored)
    listed = oc.chat.completions.list(metadata={"app": "sluice-test"}, model=MODEL, limit=1)
    assert [c.id for c in listed.data] == [made.id] and listed.has_more
    assert [c.id for c in oc.chat.completions.list(metadata={"app": "sluice-test"}, order="desc")] == \
        [streamed, made.id]  # (the SDK's iterator pages on with `after`)
    assert [c.id for c in oc.chat.completions.list(metadata={"run": "2"})] == [streamed]
    listed_messages = oc.chat.completions.messages.list(made.id)
    assert [(m.role, m.content) for m in listed_messages.data] == [("system", "Be brief."), ("user", "Hello")]
    assert listed_messages.data[1].content_parts[0].text == "Hello"
    updated = oc.chat.completions.update(made.id, metadata={"app": "other"})
    assert updated.metadata == {"app": "other"}
    assert [c.id for c in oc.chat.completions.list(metadata={"app": "sluice-test"})] == [streamed]
    assert oc.chat.completions.delete(made.id).deleted
    with pytest.raises(openai.NotFoundError):
        oc.chat.completions.delete(made.id)
    with pytest.raises(openai.BadRequestError) as e:
        oc.chat.completions.list(after="chatcmpl-nope")
    assert e.value.param == "after"


def _background(oc: openai.OpenAI) -> str:
    rid = oc.responses.create(model=MODEL, input="Hello", max_output_tokens=4, background=True).id
    deadline = time.monotonic() + 60
    while oc.responses.retrieve(rid).status not in ("completed", "incomplete"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return rid


def test_an_integer_out_of_range_in_a_query_string_is_a_400(served, oc):
    url, rid = served[0].url, _background(oc)
    for value in ("99999999999999999999999", "9223372036854775808", "-2", "abc", "²"):
        r = httpx.get(f"{url}/v1/responses/{rid}", params={"stream": "true", "starting_after": value}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after", (value, r.text)
    r = httpx.get(f"{url}/v1/responses/{rid}?stream=true&starting_after=9223372036854775807", timeout=10)
    assert r.status_code == 200 and r.text == ""  # (in range: nothing comes after it, and the stream ends)
    r = httpx.get(f"{url}/v1/responses/{rid}/input_items?limit=99999999999999999999999", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    r = httpx.get(f"{url}/v1/messages/batches?limit=99999999999999999999999", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error" and "limit" in r.text


def test_with_the_state_pulled_away_every_state_route_answers_in_its_dialect(served):
    server, state = served
    result = bench.faults.state_pulled_away(server, state)
    for method, path, status, is_json, shaped, names_it in result["answers"]:
        assert (status, is_json, shaped, names_it) == (500, True, True, True), (method, path, status)
    assert len(result["answers"]) == 22
    assert (result["store_false"], result["health"]) == ([200, 200], 200)  # what needs no state still serves
