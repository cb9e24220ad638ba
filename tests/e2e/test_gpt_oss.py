"""gpt-oss end to end: the real tiny model, and recorded harmony outputs replayed through the pipeline."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from bench.server import Server
from tests.harmony_outputs import harmony_tokens

MODEL = "builtin:tiny-gpt-oss"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def real(gpt_oss_server):
    return gpt_oss_server


def test_tiny_gpt_oss_serves_chat_and_completions(real):
    client = _client(real)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0)
    assert r.usage.completion_tokens <= 16 and r.choices[0].finish_reason in ("stop", "length", "error")
    assert "<|" not in (r.choices[0].message.content or "")  # no harmony markup leaks
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 5


def test_health_generate_runs_a_chat_message_through_harmony(real):
    r = httpx.get(real.url + "/health_generate", timeout=60)  # (tests/ingress/test_health_generate.py: the probe)
    assert r.status_code == 200 and r.json()["latency_ms"] > 0


def test_named_tool_choice_is_served(real):
    r = _client(real).chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=6, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")


def test_return_token_ids_and_logprobs(real):
    r = httpx.post(real.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "max_tokens": 4, "return_token_ids": True, "logprobs": True,
        "top_logprobs": 2, "ignore_eos": True}).json()
    choice = r["choices"][0]
    assert len(choice["token_ids"]) == 4 == len(choice["logprobs"]["content"])
    assert r["prompt_token_ids"][-2:] == [200006, 173781]  # ... <|start|>assistant
    assert len(r["prompt_token_ids"]) == r["usage"]["prompt_tokens"]


@pytest.mark.parametrize("body, feature", [
    ({"thinking_token_budget": 64}, "thinking_token_budget"),
    ({"chat_template": "{{ messages }}"}, "request_chat_template"),
])
def test_gpt_oss_rejections_are_400s_that_say_what_to_do(real, body, feature):
    r = httpx.post(real.url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body})
    assert r.status_code == 400 and feature in r.json()["error"]["message"]


# ---- recorded outputs ----------------------------------------------------------------

REASONED = [("analysis", "The user wants weather."), ("final", "It is sunny in Paris.")]
CALLING = [("analysis", "I need the tool."), ("call", "get_weather", {"city": "Paris"})]


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "harmony.jsonl"
    bad = harmony_tokens([("analysis", "hmm")])[:-1] + [200007, 200008, 200008, 200005]
    recordings = [harmony_tokens(REASONED)] * 2 + [harmony_tokens(CALLING)] * 2 + [bad]
    path.write_text("\n".join(json.dumps(r) for r in recordings))
    s = Server("--model", MODEL, "--max-model-len", "4096", "--runner", "replay", "--replay-file", str(path))
    yield s
    assert s.stop() == 0, s.output()


def _merge(chunks):
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        out["content"] += d.content or ""
        out["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
        for t in d.tool_calls or []:
            call = out["calls"].setdefault(t.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or t.id
            call["name"] = call["name"] or t.function.name
            call["arguments"] += t.function.arguments or ""
        out["finish"] = c.choices[0].finish_reason or out["finish"]
    return out


def test_recorded_harmony_outputs_parse_into_messages(replay):
    """The recordings are taken in arrival order, so this one test sends the requests in turn."""
    client = _client(replay)
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200)
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert (m.content, m.model_extra["reasoning_content"], m.tool_calls, r.choices[0].finish_reason) == (
        "It is sunny in Paris.", "The user wants weather.", None, "stop")
    s = _merge(client.chat.completions.create(stream=True, **kw))
    assert (s["content"], s["reasoning"], s["calls"], s["finish"]) == (m.content, "The user wants weather.", {}, "stop")

    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.model_extra["reasoning_content"] == "I need the tool."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    s = _merge(client.chat.completions.create(stream=True, **kw))
    assert s["finish"] == "tool_calls" and s["calls"][0]["name"] == "get_weather"
    assert json.loads(s["calls"][0]["arguments"]) == {"city": "Paris"} and s["calls"][0]["id"].startswith("call_")

    r = client.chat.completions.create(**kw)  # malformed: what was parsed, and a clear finish reason
    assert r.choices[0].finish_reason == "error" and r.choices[0].message.model_extra["reasoning_content"] == "hmm"
    assert httpx.get(replay.url + "/health").status_code == 200  # and the server is fine


@pytest.fixture(scope="module")
def text_parsers(tmp_path_factory, tiny_chat_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json"))
    text = ('<think>Plan: call the tool.</think>Sure.'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    ids = tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("<|im_end|>")]
    path = tmp_path_factory.mktemp("replay") / "text.jsonl"
    path.write_text("\n".join(json.dumps(ids) for _ in range(3)))
    s = Server("--runner", "replay", "--replay-file", str(path), "--reasoning-parser", "think",
               "--tool-parser", "hermes",
               "--no-coalesce-frames")
    yield s
    assert s.stop() == 0, s.output()


def test_think_and_hermes_parsers_end_to_end(text_parsers):
    client = _client(text_parsers)
    kw = dict(model="builtin:tiny-chat", messages=ASK, tools=TOOLS, max_tokens=200)
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert m.content == "Sure." and m.model_extra["reasoning_content"] == "Plan: call the tool."
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    s = _merge(client.chat.completions.create(stream=True, **kw))
    assert (s["content"], s["reasoning"], s["finish"]) == ("Sure.", "Plan: call the tool.", "tool_calls")
    assert s["calls"][0]["name"] == "get_weather" and json.loads(s["calls"][0]["arguments"]) == {"city": "Paris"}
    # vLLM's include_reasoning=false: the answer without the reasoning; SGLang's fields as its router sends them
    quiet = {"include_reasoning": False, "separate_reasoning": True, "stream_reasoning": True,
             "continue_final_message": False, "return_hidden_states": False}
    m = client.chat.completions.create(extra_body=quiet, **kw).choices[0].message
    assert m.content == "Sure." and not m.model_extra.get("reasoning_content") and m.tool_calls
    s = _merge(client.chat.completions.create(stream=True, extra_body=quiet, **kw))
    assert (s["content"], s["reasoning"], s["finish"]) == ("Sure.", "", "tool_calls")
    for field, value in [("separate_reasoning", False), ("stream_reasoning", False), ("return_hidden_states", True)]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(extra_body={field: value}, **kw)
        assert e.value.body["param"] == field
    # The replay engine runs far ahead of the postproc; --no-coalesce-frames still sends a token per event.
    chunks = client.completions.create(model=kw["model"], prompt="Weather?", max_tokens=200, stream=True,
                                       extra_body={"return_token_ids": True})
    ids = [c.choices[0].model_extra["token_ids"] for c in chunks if c.choices]
    assert [len(i) for i in ids] == [1] * r.usage.completion_tokens
