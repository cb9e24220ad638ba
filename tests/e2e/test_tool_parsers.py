"""A tool format other than hermes through a real server (issue 33): tiny-chat's weights with Mistral's
`[TOOL_CALLS]` and `[ARGS]` as special tokens of its vocabulary and in its template, served with
`--tool-parser auto`. The random-weight model's calls are held by the mistral grammar, come back parsed
streamed and not, and the markers survive detokenization though they are special tokens. (Each format's
grammar and parser, one by one: tests/render/test_tool_formats.py, tests/postproc/test_tool_parsers.py.)"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import AddedToken, Tokenizer

from bench.server import Server
from sluice.app.builtin_models import resolve_model
from tests.e2e.conftest import MODEL
from tests.e2e.test_tool_calling import ASK, NAMED, SCHEMAS, TOOLS, check_calls, client_of

MARKERS = ["[TOOL_CALLS]", "[ARGS]"]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    source, path = resolve_model(MODEL), tmp_path_factory.mktemp("mistral-style")
    for f in source.iterdir():
        if f.name not in ("tokenizer.json", "chat_template.jinja"):
            (path / f.name).symlink_to(f)
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MARKERS])
    config = json.loads((source / "config.json").read_text())
    assert tokenizer.get_vocab_size() <= config["vocab_size"]  # (the new tokens have rows in the embedding)
    tokenizer.save(str(path / "tokenizer.json"))
    template = (source / "chat_template.jinja").read_text().replace("<tool_call>", "[TOOL_CALLS]")
    (path / "chat_template.jinja").write_text(template.replace("</tool_call>", ""))
    server = Server("--model", str(path), "--served-model-name", "m", "--tool-parser", "auto")
    yield server, client_of(server), tokenizer.token_to_id("[TOOL_CALLS]")
    assert server.stop() == 0, server.output()


def _calls(client, stream: bool, **kw) -> tuple[list, str | None]:
    args = dict(model="m", messages=ASK, tools=TOOLS, temperature=1.0, max_tokens=120, **kw)
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        return choice.message.tool_calls or [], choice.finish_reason
    merged, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **args):
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
            for delta in chunk.choices[0].delta.tool_calls or []:
                call = merged.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    return [type("Call", (), {"function": type("F", (), c)}) for c in merged.values()], finish


def test_auto_chose_mistral_from_the_template(mistral):
    assert "--tool-parser auto: mistral (from the chat template)" in mistral[0].output()


def test_required_named_and_one_call_only_hold_streamed_and_not(mistral):
    _, client, _ = mistral
    runs = [dict(tool_choice="required", seed=i, parallel_tool_calls=bool(i % 2), stream=bool(i % 3))
            for i in range(12)] + [dict(tool_choice=NAMED, seed=i, stream=bool(i % 2)) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda kw: _calls(client, **kw), runs))
    for kw, (calls, finish) in zip(runs, results):
        assert finish == "tool_calls" and calls, kw
        check_calls(calls, ["get_time"] if kw["tool_choice"] == NAMED else SCHEMAS)
        if kw.get("parallel_tool_calls") is False:
            assert len(calls) == 1


def test_strict_tools_hold_a_call_the_model_starts_on_its_own(mistral):
    _, client, tag = mistral
    runs = [dict(tool_choice="auto", seed=i, logit_bias={str(tag): 100}, parallel_tool_calls=False,
                 stream=bool(i % 2)) for i in range(10)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda kw: _calls(client, **kw), runs))
    assert sum(bool(calls) for calls, _ in results) >= 8
    for calls, _ in results:
        check_calls(calls)
