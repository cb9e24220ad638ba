"""Servers behind one router share the key that seals reasoning (--sealing-key-file): reasoning one of them sealed
for a client that stores nothing is opened by another that holds the same key, and refused (a clean 400) by a
server with a key of its own."""
from __future__ import annotations

import base64
import json
import os

import httpx
import pytest

from bench.server import Server

MODEL = "builtin:tiny-chat"
ASK = "Weather in Paris?"
RECORDED = "<think>Plan: call the tool.</think>Sure."


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_chat_dir):
    """Two servers on state directories of their own, sharing one sealing key file, both answering RECORDED."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json"))
    tmp = tmp_path_factory.mktemp("shared-key")
    replay = tmp / "text.jsonl"
    replay.write_text(json.dumps(tok.encode(RECORDED, add_special_tokens=False).ids + [tok.token_to_id("<|im_end|>")]))
    key = tmp / "sealing.key"
    key.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")  # (as `openssl rand -base64 32` writes one)
    servers = [Server("--runner", "replay", "--replay-file", str(replay), "--reasoning-parser", "think",
                      "--sealing-key-file", str(key), "--state-dir", str(tmp / f"state-{i}")) for i in range(2)]
    yield servers
    for s in servers:
        assert s.stop() == 0, s.output()


def _respond(url: str, input) -> httpx.Response:
    return httpx.post(url + "/v1/responses", timeout=60, json={
        "model": MODEL, "input": input, "store": False, "include": ["reasoning.encrypted_content"]})


def test_reasoning_sealed_by_one_server_opens_on_another_with_the_key_and_not_on_one_without(pair, server):
    sealer, opener = pair
    first = _respond(sealer.url, ASK)
    assert first.status_code == 200, first.text
    reasoning = first.json()["output"][0]
    assert reasoning["type"] == "reasoning" and reasoning["encrypted_content"].startswith("v1.")
    again = [{"type": "message", "role": "user", "content": ASK},
             {"type": "reasoning", "summary": [], "encrypted_content": reasoning["encrypted_content"]}]
    plain = [again[0]]
    opened, without = _respond(opener.url, again), _respond(opener.url, plain)
    assert opened.status_code == 200, opened.text
    # (its <think> block was rendered into the prompt)
    assert opened.json()["usage"]["input_tokens"] > without.json()["usage"]["input_tokens"]
    refused = _respond(server.url, again)  # (the shared server: a key of its own, under its state directory)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "input[1].encrypted_content"
