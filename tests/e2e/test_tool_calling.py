"""Tool calls that hold (issue 18): tool_choice required, a named function, strict tools and
parallel_tool_calls false, on random-weight models (the grammar must force valid calls out of gibberish
logits), and the vLLM-style structured_outputs kinds. Each check samples many requests at once."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from bench.server import Server
from tests.e2e.conftest import MODEL

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME, "strict": True}}]
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}
LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}  # a $ref that only refers to itself
SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # must contain itself
LOOP_TOOL = {"type": "function", "function": {"name": "loop", "parameters": LOOP}}


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def sample(client: openai.OpenAI, model: str, runs: list[dict]) -> list:
    def one(kw: dict):
        return client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=1.0, **kw)
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, runs))


def check_calls(calls, names=SCHEMAS) -> None:
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.fixture(scope="module")
def hermes():
    s = Server("--tool-parser", "hermes")
    yield client_of(s)
    assert s.stop() == 0, s.output()


def test_required_named_and_one_call_only_hold_on_every_sample(hermes):
    runs = [dict(tool_choice="required", seed=i, max_tokens=120, parallel_tool_calls=bool(i % 2)) for i in range(40)]
    runs += [dict(tool_choice=NAMED, seed=i, max_tokens=120) for i in range(30)]
    for kw, r in zip(runs, sample(hermes, MODEL, runs)):
        choice = r.choices[0]
        calls = choice.message.tool_calls or []
        assert choice.finish_reason == "tool_calls" and calls, (kw, choice)
        check_calls(calls, ["get_time"] if kw["tool_choice"] == NAMED else SCHEMAS)
        if kw.get("parallel_tool_calls") is False:
            assert len(calls) == 1


def test_strict_tools_hold_a_call_the_model_starts_on_its_own(hermes):
    """tool_choice auto: the text is free; pushed to open a call (logit_bias on the <tool_call> token), the
    call it makes must fit its tool's schema."""
    from tokenizers import Tokenizer

    from sluice.app.builtin_models import resolve_model

    tag = Tokenizer.from_file(str(resolve_model(MODEL) / "tokenizer.json")).token_to_id("<tool_call>")
    # (one call each: the bias would open calls until max_tokens cuts the last one short)
    runs = [dict(tool_choice="auto", seed=i, max_tokens=120, logit_bias={str(tag): 100}, parallel_tool_calls=False)
            for i in range(30)]
    made = 0
    for r in sample(hermes, MODEL, runs):
        calls = r.choices[0].message.tool_calls or []
        made += bool(calls)
        check_calls(calls)
    assert made >= 25


@pytest.fixture(scope="module")
def gpt_oss(gpt_oss_server):
    return client_of(gpt_oss_server)


def test_gpt_oss_forced_calls_hold_and_its_reasoning_stays_free(gpt_oss):
    """Named calls always fit. `required`: reasoning (the analysis channel) is free, so a random model may
    spend its whole budget there; every output that ends does so with a call that fits."""
    runs = [dict(tool_choice=NAMED, seed=i, max_tokens=60) for i in range(15)]
    runs += [dict(tool_choice="required", seed=i, max_tokens=120) for i in range(15)]
    called = 0
    for kw, r in zip(runs, sample(gpt_oss, "builtin:tiny-gpt-oss", runs)):
        choice = r.choices[0]
        calls = choice.message.tool_calls or []
        check_calls(calls)
        if kw["tool_choice"] == NAMED:
            assert choice.finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_time"]
        else:
            assert choice.finish_reason == ("tool_calls" if calls else "length"), choice
            called += bool(calls)
    assert called >= 3


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("kind, value, check", [
    ("regex", "[a-z]{3}-[0-9]{2}", lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2}", t)),
    ("choice", ["red", "green", "blue"], lambda t: t in ("red", "green", "blue")),
    ("grammar", 'root ::= "yes" | "no" | "maybe " [0-9]', lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t)),
    ("grammar", 'start: "ok" NUM\nNUM: /[0-9]{2}/', lambda t: re.fullmatch(r"ok[0-9]{2}", t)),
    ("json", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
     lambda t: isinstance(json.loads(t), list)),
])
def test_structured_outputs_match(client, endpoint, kind, value, check):
    extra = {"structured_outputs": {kind: value}}
    for seed in range(6):
        if endpoint == "chat":
            r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, seed=seed, temperature=1.0,
                                               extra_body=extra)
            text, reason = r.choices[0].message.content, r.choices[0].finish_reason
        else:
            c = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=40, seed=seed, temperature=1.0,
                                          extra_body=extra)
            text, reason = c.choices[0].text, c.choices[0].finish_reason
        assert reason == "stop" and check(text), (text, reason)


@pytest.mark.parametrize("kw, param", [
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required", tools=None), "tool_choice"),
    (dict(tool_choice="required", extra_body={"prompt_token_ids": [5, 6, 7]}), "tool_choice"),
    (dict(tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"regex": "(unclosed"}}), "structured_outputs.regex"),
    (dict(extra_body={"structured_outputs": {"json": {"type": "string", "minLength": 3, "maxLength": 1}}}),
     "structured_outputs.json"),
    # issue 37: constraints no output can match, and fields that leave no token the grammar allows
    (dict(tool_choice="required", tools=[LOOP_TOOL]), "tools"),
    (dict(tool_choice={"type": "function", "function": {"name": "loop"}}, tools=[LOOP_TOOL]), "tools"),
    (dict(tools=None, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": LOOP}}),
     "response_format"),
    (dict(tools=None, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SELF}}),
     "response_format"),
    (dict(tools=None, extra_body={"structured_outputs": {"regex": r"[^\s\S]"}}), "structured_outputs.regex"),
    (dict(tools=None, extra_body={"structured_outputs": {"grammar": "root ::= root"}}), "structured_outputs.grammar"),
    (dict(tools=None, extra_body={"structured_outputs": {"choice": ["yes", "no"]}, "allowed_token_ids": [5]}),
     "allowed_token_ids"),
    (dict(tools=None, extra_body={"structured_outputs": {"regex": "a"}, "bad_words": ["a"]}), "bad_words"),
])
def test_what_cannot_hold_is_a_400_that_names_it(hermes, kw, param):
    args = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8)
    args.update(kw)
    if args["tools"] is None:
        del args["tools"]
    with pytest.raises(openai.BadRequestError) as e:
        hermes.chat.completions.create(**args)
    assert e.value.body["param"] == param, e.value.body
    assert_short(e.value.body["message"])


def assert_short(message: str) -> None:
    """An error a client can read: a few hundred characters, none of a grammar engine's internals."""
    assert len(message) < 300 and not any(s in message for s in ("<state>", "<grammar>", "Parser", "\n")), message


def test_a_loop_schema_under_anthropic_tool_choice_any_is_the_same_400_streamed_or_not(hermes):
    """It leaked the forced call's raw `<tool_call>` text as a text block when max_tokens cut it short."""
    url = str(hermes.base_url).rstrip("/") + "/messages"
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "loop", "input_schema": LOOP}], "tool_choice": {"type": "any"}}
    for stream in (False, True):
        r = httpx.post(url, json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 400 and "<tool_call>" not in r.text, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"].startswith("tools:"), error
        assert_short(error["message"])


def test_a_constraint_that_starves_mid_flight_fails_alone(hermes):
    """allowed_token_ids that leave no token the grammar allows are met at the engine's first mask: that
    request ends with its 400, and a stream beside it goes on to its end."""
    with ThreadPoolExecutor(2) as pool:
        beside = pool.submit(lambda: list(hermes.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=24, stream=True, extra_body={"ignore_eos": True})))
        starved = pool.submit(lambda: hermes.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=8, extra_body={"structured_outputs": {"choice": ["yes", "no"]},
                                                                  "allowed_token_ids": [5, 6]}))
        with pytest.raises(openai.BadRequestError) as e:
            starved.result()
        chunks = beside.result()
    assert e.value.body["param"] == "allowed_token_ids"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_model_without_a_tool_parser_says_what_forcing_a_call_needs(client):
    with pytest.raises(openai.BadRequestError, match="tool-parser hermes"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=8)
