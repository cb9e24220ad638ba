"""What crossed the engine / postproc boundary wrongly in the adversarial run, end to end."""
from __future__ import annotations

import json
import signal
import threading

import httpx
import openai
import pytest

from bench.server import Server
from tests.e2e.conftest import MODEL

MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]


def stop_string_of(client, seed: int) -> str:
    """Two characters that the seeded request's first choice surely produces."""
    text = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0.8,
                                          seed=seed).choices[0].message.content
    return next(text[i:i + 2] for i in range(len(text) - 1) if text[i:i + 2].strip())


@pytest.mark.parametrize("stream", [False, True])
def test_n3_with_a_stop_string_gets_its_answer(client, stream):
    """The hang: one choice stopped by a string made the shard drop the whole request, whose other choices
    went on in the engine with nobody to answer the client."""
    stop = stop_string_of(client, seed=11)
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0.8, n=3, stop=[stop], seed=11,
                  timeout=30)
    if not stream:
        r = client.chat.completions.create(**kwargs)
        assert len(r.choices) == 3 and r.choices[0].finish_reason == "stop"
        assert all(stop not in c.message.content for c in r.choices)
        return
    reasons = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert sorted(reasons) == [0, 1, 2] and reasons[0] == "stop"


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def test_structured_output_with_ignore_eos_ends_where_the_grammar_ends(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, n=2,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "n", "schema": SCHEMA}},
                                       extra_body={"ignore_eos": True})
    for c in r.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content)["n"], int)


def test_a_grammar_finished_before_min_tokens_ends_the_output(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "one", "schema": {"const": 1}}},
                                       extra_body={"min_tokens": 20})
    assert r.choices[0].message.content == "1" and r.choices[0].finish_reason == "stop"


TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b")]


@pytest.fixture(scope="module")
def two_calls(tmp_path_factory, tiny_chat_dir):
    """A replay server whose model answers with two hermes tool calls, then text, 5 ms a token (the drain
    test, the last, stops it with a long stream in flight)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json"))
    text = ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {"y": 2}}\n</tool_call> and some text')
    ids = tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("<|im_end|>")]
    path = tmp_path_factory.mktemp("replay") / "calls.jsonl"
    path.write_text(json.dumps(ids) + "\n")
    s = Server("--runner", "replay", "--replay-file", str(path), "--tool-parser", "hermes", "--replay-step-ms", "5",
               "--shutdown-timeout", "1")
    yield s
    assert s.stop() == 0, s.output()


def _calls(server: Server, stream: bool, **kw) -> tuple[list[tuple[str, dict]], str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, **kw)
    if not stream:
        r = client.chat.completions.create(**kw)
        calls = r.choices[0].message.tool_calls or []
        return [(c.function.name, json.loads(c.function.arguments)) for c in calls], r.choices[0].finish_reason
    parts: dict[int, list] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                part = parts.setdefault(d.index, [None, ""])
                part[0] = d.function.name or part[0]
                part[1] += d.function.arguments or ""
    return [(name, json.loads(args)) for name, args in parts.values()], finish


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_gives_at_most_one_call(two_calls, stream):
    assert _calls(two_calls, stream) == ([("a", {"x": 1}), ("b", {"y": 2})], "tool_calls")
    assert _calls(two_calls, stream, parallel_tool_calls=False) == ([("a", {"x": 1})], "tool_calls")


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None and c.usage.prompt_tokens == chunks[0].usage.prompt_tokens for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 12 and counts[1] >= 1
    plain = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=True,
                                                stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage is not None


def test_a_drain_that_times_out_says_so(two_calls):
    """--shutdown-timeout expiring used to tell clients 'the engine process died'. A stream of 10 s, a drain
    of 1 s: last in the module, it stops `two_calls`."""
    server = two_calls
    try:
        lines: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    started.set()
                    lines.append(line)

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert started.wait(30)
        server.proc.send_signal(signal.SIGTERM)
        t.join(20)
        assert not t.is_alive()
        events = [x for x in lines if x]
        errors = [json.loads(x[6:])["error"] for x in events if x.startswith("data: {\"error\"")]
        assert len(errors) == 1 and events[-1] == "data: [DONE]", events[-3:]
        assert "drain timeout" in errors[0]["message"] and "engine" not in errors[0]["message"]
        assert errors[0]["code"] == "shutting_down"
        assert server.proc.wait(30) == 0
    finally:
        server.stop(signal.SIGKILL)
