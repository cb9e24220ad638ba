"""The full sampling surface and pre-tokenized input, against the shared server."""
from __future__ import annotations

import base64
import json
import math

import httpx
import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.e2e.conftest import MODEL

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 30}


@pytest.fixture(scope="module")
def tok(tiny_chat_dir):
    return Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json"))


def _b64(ids) -> str:
    return base64.b64encode(np.asarray(ids, dtype="<i4").tobytes()).decode()


def test_prefix_cache_reuse_is_reported_and_salts_isolate(client):
    def chat(question, salt=None):
        extra = {"cache_salt": salt} if salt else {}
        r = client.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content": question}],
                                           max_tokens=2, extra_body=extra)
        return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens

    prompt, cached = chat("first question", salt="tenant-a")
    assert cached == 0
    prompt2, cached2 = chat("second question", salt="tenant-a")
    assert cached2 >= 16 * ((prompt - 20) // 16) and cached2 % 16 == 0 and cached2 < prompt2
    assert chat("third question", salt="tenant-b")[1] == 0  # another tenant shares nothing
    assert chat("fourth question")[1] == 0  # nor does the unsalted default
    assert chat("fifth question")[1] > 0


def test_n_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3, seed=7,
                                       max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1
    assert r.usage.completion_tokens == 24
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3, seed=7,
                                           max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    stream = client.completions.create(model=MODEL, prompt="hi", n=2, max_tokens=5, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1} and chunks[-1].usage.completion_tokens == 10


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy picks the top token
        assert entry.token == entry.top_logprobs[0].token
        assert sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1.0 + 1e-5
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).choices[0].logprobs is None


def test_completion_logprobs_echo_and_prompt_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The river runs", max_tokens=4, logprobs=2, echo=True,
                                  extra_body={"ignore_eos": True, "prompt_logprobs": 1})
    choice = r.choices[0]
    assert choice.text.startswith("The river runs")
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == len("The river runs")
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    prompt_lps = choice.model_extra["prompt_logprobs"]
    assert len(prompt_lps) == r.usage.prompt_tokens and prompt_lps[0] is None
    assert all(1 <= len(p) <= 2 and all(v["logprob"] <= 0 for v in p.values()) for p in prompt_lps[1:])


def test_include_stop_str_and_special_tokens(client, tok):
    base = dict(model=MODEL, prompt="hello there", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**base).choices[0].text
    stop = text[4:6]
    r = client.completions.create(stop=[stop], **dict(base, extra_body={"ignore_eos": True,
                                                                       "include_stop_str_in_output": True}))
    assert r.choices[0].text == text[: text.index(stop) + len(stop)]
    im_end = tok.token_to_id("<|im_end|>")
    kw = dict(model=MODEL, prompt="x", max_tokens=3)
    shown = client.completions.create(**kw, extra_body={"allowed_token_ids": [im_end], "ignore_eos": True,
                                                        "skip_special_tokens": False})
    assert shown.choices[0].text == "<|im_end|>" * 3
    hidden = client.completions.create(**kw, extra_body={"allowed_token_ids": [im_end], "ignore_eos": True})
    assert hidden.choices[0].text == ""


def test_allowed_and_bad_words(client, tok):
    allowed = tok.encode(" river", add_special_tokens=False).ids + tok.encode(" sea", add_special_tokens=False).ids
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=12, logprobs=0,
                                  extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    assert set(r.choices[0].logprobs.tokens) <= {tok.decode([i]) for i in allowed}
    kw = dict(model=MODEL, prompt="hello there", max_tokens=16, temperature=0, logprobs=0,
              extra_body={"ignore_eos": True})
    tokens = client.completions.create(**kw).choices[0].logprobs.tokens
    word = next(t for t in tokens if t.strip())
    r = client.completions.create(**dict(kw, extra_body={"ignore_eos": True, "bad_words": [word.strip()]}))
    assert word not in r.choices[0].logprobs.tokens


def test_penalties_change_greedy_output(client):
    kw = dict(model=MODEL, prompt="hello there", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].text
    for extra in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 3.0}):
        text = client.completions.create(**dict(kw, extra_body={"ignore_eos": True, **extra})).choices[0].text
        assert text != plain, extra


def test_pretokenized_prompts(server, client):
    ids = [5, 6, 7, 8, 9, 10]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ignored"}], max_tokens=2,
                                       extra_body={"prompt_token_ids": ids, "return_prompt_token_ids_b64": True})
    assert r.usage.prompt_tokens == 6 and r.model_extra["prompt_token_ids_b64"] == _b64(ids)
    r = client.completions.create(model=MODEL, prompt="", max_tokens=2,
                                  extra_body={"prompt_token_ids_b64": _b64(ids)})
    assert r.usage.prompt_tokens == 6
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          extra_body={"return_prompt_token_ids_b64": True})
    rendered = np.frombuffer(base64.b64decode(chat.model_extra["prompt_token_ids_b64"]), dtype="<i4")
    assert len(rendered) == chat.usage.prompt_tokens


@pytest.mark.parametrize("value, why", [
    ("not base64!!", "base64"),
    (base64.b64encode(b"abc").decode(), "multiple of 4"),
    (base64.b64encode(np.array([5, 10**8], dtype="<i4").tobytes()).decode(), "token ids"),
])
def test_bad_pretokenized_prompts_name_the_field(server, value, why):
    for path, body in (("/v1/completions", {"prompt": ""}), ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "x"}]})):
        r = httpx.post(server.url + path, json={"model": MODEL, "prompt_token_ids_b64": value, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt_token_ids_b64" and why in err["message"]


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias[...]"),
    ({"allowed_token_ids": [10**8]}, "allowed_token_ids"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"n": 0}, "n"),
])
def test_bad_sampling_params(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_n_choices_with_prompt_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The river runs", max_tokens=3, n=3,
                                  extra_body={"ignore_eos": True, "prompt_logprobs": 1})
    assert len(r.choices) == 3
    assert all(len(c.model_extra["prompt_logprobs"]) == r.usage.prompt_tokens for c in r.choices)


def test_response_format(server, client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2]}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json please"}],
                                       max_tokens=60, seed=3,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "answer", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"ok", "n"} and value["n"] in (1, 2)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json please"}],
                                       max_tokens=30, seed=1, response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    bad = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
