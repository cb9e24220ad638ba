"""The hand-off when things go wrong, and gpt-oss's harmony tool calls across the split (replay runner)."""
from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from bench.server import Server
from tests.disagg.helpers import SECRET, Trio, comparable, context, generation, kv_used, two_hop
from tests.harmony_outputs import harmony_tokens

CHAT = {"model": "builtin:tiny-chat", "messages": [{"role": "user", "content": "Numbers: 1 2 3 4 5 6 7 8 9 " * 4}],
        "max_tokens": 16, "temperature": 0, "return_token_ids": True}


def test_a_context_worker_gone_before_the_read(trio):
    """SIGKILL: its cache files outlive it, and the KV in them is whole (nothing can change it any more).
    SIGTERM: it removes them; the generation worker recomputes, or fails the request when told to."""
    strict = Server("--role", "generation", "--disagg-secret", SECRET, "--kv-load-failure", "fail")
    try:
        want = comparable(httpx.post(trio.agg.url + "/v1/chat/completions", json=CHAT, timeout=60), False)
        for sig in (signal.SIGKILL, signal.SIGTERM):
            ctx = Server("--role", "context", "--disagg-secret", SECRET)
            params = context(ctx.url, "/v1/chat/completions", CHAT)
            ctx.stop(sig)
            assert comparable(generation(trio.gen.url, "/v1/chat/completions", CHAT, params), False) == want
        r = generation(strict.url, "/v1/chat/completions", CHAT, params)
        assert r.status_code == 500 and "could not be loaded from the context worker" in r.json()["error"]["message"]
        for s in (trio.gen, strict):
            assert kv_used(s) == 0
    finally:
        strict.stop()


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def harmony_trio(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "calling.jsonl"
    path.write_text(json.dumps(harmony_tokens([("analysis", "I need the tool."),
                                               ("call", "get_weather", {"city": "Paris"})])))
    t = Trio(common=("--model", "builtin:tiny-gpt-oss", "--max-model-len", "4096", "--runner", "replay",
                     "--replay-file", str(path)), agg=False)  # (the replay's tokens are what one server gives)
    t.tokens = json.loads(path.read_text())
    yield t
    t.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_gpt_oss_tool_calls_across_the_split_equal_the_aggregated(harmony_trio, stream):
    t = harmony_trio
    req = {"model": "builtin:tiny-gpt-oss", "messages": [{"role": "user", "content": "Weather in Paris?"}],
           "tools": TOOLS, "max_tokens": 200, "stream": stream, "return_token_ids": True}
    got = two_hop(t.ctx, t.gen, "/v1/chat/completions", req)
    assert [c["ids"] for c in comparable(got, stream)] == [t.tokens]
    if not stream:
        m = got.json()["choices"][0]
        assert m["finish_reason"] == "tool_calls" and m["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert m["message"]["reasoning_content"] == "I need the tool."
    else:
        assert '"tool_calls"' in got.text and "get_weather" in got.text
    deadline = time.monotonic() + 5
    while kv_used(t.ctx) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kv_used(t.ctx) == 0 and kv_used(t.gen) == 0


def test_the_mooncake_transport_hands_over_the_same_kv(trio):
    pytest.importorskip("mooncake.engine", reason="pip install mooncake-transfer-engine-non-cuda (+ apt libibverbs1)")
    t = Trio(("--kv-transfer", "mooncake"), ("--kv-transfer", "mooncake"), agg=False)
    try:
        req = {**CHAT, "n": 2, "temperature": 1.0, "seed": 5}
        want = comparable(httpx.post(trio.agg.url + "/v1/chat/completions", json=req, timeout=60), False)
        assert comparable(two_hop(t.ctx, t.gen, "/v1/chat/completions", req), False) == want
        assert t.gen.metrics()["sluice:kv_transfer_bytes_total"] > 0
    finally:
        t.stop()
