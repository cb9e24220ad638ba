"""--post-processor-hook in a postproc shard: each choice's new text goes through it before the parsers;
emit changes it, suppress drops it, terminate ends the choice (and tells the engine), and a hook that fails
fails its request alone."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from sluice.base import hooks
from sluice.ipc.messages import Finished, Logprobs, StepOutputs, bytes_to_ids, ids_to_bytes
from sluice.ipc.token_frames import decode_chunks
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
    out, to_engine = shard.on_steps([StepOutputs([start(shard, "r1")], ["r1"], ids_to_bytes([0]),
                                                 ids_to_bytes(ids[:1]), [])])
    (frame,) = out["ipc://r"]
    assert frame.done and frame.data == b"" and frame.error is not None and frame.error.status == 500
    assert shard.requests == {} and "post-processor hook" in caplog.text


def scored_steps(shard, rid, ids, started):
    """One step a token, each with its logprob (token i: -(i + 1) / 8, exact in float32) and itself as top 1."""
    steps = []
    for i, tok in enumerate(ids):
        lp = np.array([-(i + 1) / 8], dtype=np.float32)
        scored = Logprobs(lp.tobytes(), ids_to_bytes([1]), ids_to_bytes([tok]), lp.tobytes(), 1)
        steps.append(StepOutputs([started] if i == 0 else [], [rid], ids_to_bytes([0]), ids_to_bytes([tok]),
                                 [Finished(rid, 0, "length")] if i == len(ids) - 1 else [], logprobs=[(0, scored)]))
    data = []
    for step in steps:
        out, _ = shard.on_steps([step])
        data += [f.data for f in out.get("ipc://r", [])]
    return data


def shown(choices, chat):
    """The token ids and logprobs a body's or a stream's choices show, in order."""
    ids, lps = [], []
    for c in choices:
        ids += c.get("token_ids") or []
        if c.get("logprobs"):
            lps += [e["logprob"] for e in c["logprobs"]["content"]] if chat else c["logprobs"]["token_logprobs"]
    return ids, lps


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_suppressed_text_withholds_its_token_ids_and_logprobs_too(tiny_chat_dir, endpoint):
    shard = shard_with(tiny_chat_dir, lambda c: hooks.suppress() if "river" in c.text_diff else hooks.emit(c.text_diff))
    ids = shard.tokenizer.encode("The river runs by", add_special_tokens=False).ids
    kept = [i for i, t in enumerate(ids) if "river" not in shard.tokenizer.decode([t])]
    assert 0 < len(kept) < len(ids)
    data = scored_steps(shard, "r1", ids, start(shard, "r1", endpoint=endpoint, logprobs=True, return_token_ids=True))
    choice = json.loads(data[-1])["choices"][0]
    text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
    assert "river" not in text
    assert shown([choice], endpoint == "chat") == ([ids[i] for i in kept], [-(i + 1) / 8 for i in kept])


@pytest.mark.parametrize("endpoint", ["chat", "completions", "generate"])
def test_a_terminated_stream_shows_no_id_nor_logprob_of_the_withheld_chunk(tiny_chat_dir, endpoint):
    shard = shard_with(tiny_chat_dir, hooks.load(f"{EXAMPLE}:BannedPhraseGuard", "--post-processor-hook"))
    ids = shard.tokenizer.encode("The key is swordfish and more", add_special_tokens=False).ids
    end = next(i for i in range(len(ids)) if "swordfish" in shard.tokenizer.decode(ids[:i + 1]).lower())
    # (frames every 3 tokens: the withheld token shares its frame's window with shown ones)
    data = scored_steps(shard, "r1", ids, start(shard, "r1", endpoint=endpoint, stream=True, stream_interval=3,
                                                logprobs=True, return_token_ids=True))
    if endpoint == "generate":
        chunks = [c for d in data for c in decode_chunks(d)]
        got = ([t for c in chunks for t in bytes_to_ids(c.token_ids).tolist()],
               [lp for c in chunks for lp, *_ in c.logprobs])
        assert chunks[-1].finish_reason == "stop"
    else:
        events = [e for e in sse_events(data) if e != "[DONE]" and e["choices"]]
        got = shown([e["choices"][0] for e in events], endpoint == "chat")
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert got == (ids[:end], [-(i + 1) / 8 for i in range(end)])
