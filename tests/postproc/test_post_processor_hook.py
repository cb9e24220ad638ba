"""--post-processor-hook in a postproc shard: each choice's new text goes through it before the parsers;
emit changes it, suppress drops it, terminate ends the choice (and tells the engine), and a hook that fails
fails its request alone."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from sluice.base import hooks
from sluice.postproc.worker import Shard
from tests.postproc.test_shard import feed, sse_events, start

EXAMPLE = str(Path(__file__).resolve().parents[2] / "deploy" / "hooks_example.py")


def shard_with(tiny_chat_dir, hook) -> Shard:
    return Shard(Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json")), hook=hook)


def test_emit_rewrites_the_text_streamed_or_whole(tiny_chat_dir):
    shard = shard_with(tiny_chat_dir, hooks.load(f"{EXAMPLE}:upper_case", "--post-processor-hook"))
    data, _ = feed(shard, "Hello world", started=start(shard, "r1"))
    assert json.loads(data[-1])["choices"][0]["message"]["content"] == "HELLO WORLD"
    data, _ = feed(shard, "Hello world", rid="r2", started=start(shard, "r2", stream=True))
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in sse_events(data)[:-1]) == "HELLO WORLD"


def test_the_hook_sees_each_chunk_before_the_reasoning_parser(tiny_chat_dir):
    seen = []

    def hook(chunk):
        seen.append(chunk)
        return hooks.emit(chunk.text_diff.replace("e", "3"))  # (no e in <think> nor </think>)

    shard = shard_with(tiny_chat_dir, hook)
    data, _ = feed(shard, "<think>a secret plan</think>Done", started=start(shard, "r1", parsers=["think"]))
    message = json.loads(data[-1])["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("a s3cr3t plan", "Don3")
    assert "".join(c.text_diff for c in seen) == seen[-1].text == "<think>a secret plan</think>Done"
    assert [c.is_final for c in seen] == [False] * (len(seen) - 1) + [True]
    assert {(c.request_id, c.index) for c in seen} == {("r1", 0)}


def test_terminate_ends_the_choice_here_and_tells_the_engine(tiny_chat_dir):
    shard = shard_with(tiny_chat_dir, hooks.load(f"{EXAMPLE}:BannedPhraseGuard", "--post-processor-hook"))
    data, stopped = feed(shard, "The key is swordfish and more", started=start(shard, "r1", endpoint="completions"))
    choice = json.loads(data[-1])["choices"][0]
    assert choice["finish_reason"] == "stop" and "swordfish" not in choice["text"]
    assert choice["text"].startswith("The key is") and stopped == [("r1", 0)] and shard.requests == {}


def test_suppress_withholds_the_text(tiny_chat_dir):
    shard = shard_with(tiny_chat_dir, lambda c: hooks.suppress() if "river" in c.text_diff else hooks.emit(c.text_diff))
    data, _ = feed(shard, "The river runs", started=start(shard, "r1", endpoint="completions"))
    assert json.loads(data[-1])["choices"][0]["text"].split() == ["The", "runs"]


@pytest.mark.parametrize("hook", [lambda c: 1 / 0, lambda c: c.text_diff])
def test_a_hook_that_fails_or_answers_wrong_fails_its_request_closed(tiny_chat_dir, hook, caplog):
    shard = shard_with(tiny_chat_dir, hook)
    ids = shard.tokenizer.encode("Hello", add_special_tokens=False).ids
    from sluice.ipc.messages import StepOutputs, ids_to_bytes
    out, to_engine = shard.on_steps([StepOutputs([start(shard, "r1")], ["r1"], ids_to_bytes([0]),
                                                 ids_to_bytes(ids[:1]), [])])
    (frame,) = out["ipc://r"]
    assert frame.done and frame.data == b"" and frame.error is not None and frame.error.status == 500
    assert shard.requests == {} and "post-processor hook" in caplog.text
