"""A postproc shard fed fake engine steps."""
from __future__ import annotations

import itertools
import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from sluice.ipc.messages import Abort, EndChoices, Failed, Finished, PostprocSpec, Started, StepOutputs, ids_to_bytes
from sluice.postproc.worker import Shard, parts


@pytest.fixture
def shard(tiny_chat_dir):
    return Shard(Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json")))


def start(shard, rid, **spec):
    spec = PostprocSpec(request_id=rid, endpoint=spec.pop("endpoint", "chat"), model="m", created=1,
                        reply_to="ipc://r", **spec)
    return Started(rid, msgspec.msgpack.encode(spec), num_prompt_tokens=5, num_cached_tokens=2)


def feed(shard, text, rid="r1", started=None, final="length", eos=None, groups=None, frames=None):
    """Feeds `text` token by token, one step each, the steps handed over in `groups` of the given sizes
    (default: one at a time); returns every frame's data in order (and adds the frames to `frames`)."""
    ids = shard.tokenizer.encode(text, add_special_tokens=False).ids + ([eos] if eos is not None else [])
    steps = [StepOutputs([started] if (i == 0 and started) else [], [rid], ids_to_bytes([0]), ids_to_bytes([tok]),
                         [Finished(rid, 0, "stop_token" if eos is not None else final)] if i == len(ids) - 1 else [])
             for i, tok in enumerate(ids)]
    data, stopped = [], []
    for size in itertools.chain(groups or [], itertools.repeat(1)):
        if not steps:
            break
        out, to_engine = shard.on_steps(steps[:size])
        del steps[:size]
        data += [f.data for f in out.get("ipc://r", [])]
        if frames is not None:
            frames += out.get("ipc://r", [])
        stopped += [choice for m in to_engine if isinstance(m, EndChoices) for choice in m.choices]
    return data, stopped


def sse_events(data):
    events = [e for chunk in data for e in chunk.decode().split("\n\n") if e]
    return [json.loads(e[6:]) if e != "data: [DONE]" else "[DONE]" for e in events]


def test_streaming_chat_frames_and_usage(shard):
    data, _ = feed(shard, "Hello world", started=start(shard, "r1", stream=True, include_usage=True))
    events = sse_events(data)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-2])
    assert text == "Hello world"
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    n = len(shard.tokenizer.encode("Hello world", add_special_tokens=False).ids)
    assert events[-2]["choices"] == [] and events[-2]["usage"] == {
        "prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n,
        "prompt_tokens_details": {"cached_tokens": 2}}
    assert events[-1] == "[DONE]" and shard.requests == {}


@pytest.mark.parametrize(("endpoint", "closing"), [
    ("chat", b"data: [DONE]\n\n"), ("messages", b'event: message_stop\ndata: {"type":"message_stop"}\n\n')],
    ids=["openai", "anthropic"])
def test_a_streams_last_frame_sizes_its_closing_event(shard, endpoint, closing):
    """(What the ingress cuts, without parsing the SSE, to put an error there when the output cannot be stored.)"""
    frames: list = []
    feed(shard, "Hi there", started=start(shard, "r1", stream=True, include_usage=True, endpoint=endpoint),
         frames=frames)
    assert [f.sizes for f in frames[:-1]] == [[]] * (len(frames) - 1)
    assert frames[-1].done and frames[-1].events() == [closing] and frames[-1].data.endswith(closing)


def test_non_streaming_body_hides_the_stop_token(shard):
    eos = shard.tokenizer.token_to_id("<|im_end|>")
    data, _ = feed(shard, "Good evening", started=start(shard, "r1"), eos=eos)
    body = json.loads(data[-1])
    assert len(data) == 1 and body["object"] == "chat.completion"
    assert body["choices"][0] == {"index": 0, "message": {"content": "Good evening", "role": "assistant"},
                                  "finish_reason": "stop", "logprobs": None, "token_ids": None}


def test_stop_string_ends_the_request_and_ends_its_choice_in_the_engine(shard):
    data, stopped = feed(shard, "The river runs to the sea", started=start(shard, "r1", stop=["runs"],
                                                                                endpoint="completions"))
    body = json.loads(data[-1])
    assert body["choices"][0]["text"] == "The river " and body["choices"][0]["finish_reason"] == "stop"
    assert stopped == [("r1", 0)] and shard.requests == {}
    out, _ = shard.on_steps([StepOutputs([], ["r1"], ids_to_bytes([0]), ids_to_bytes([5]), [])])
    assert out == {}  # a token already in flight for it


def test_abort_drops_state_silently(shard):
    shard.on_steps([StepOutputs([start(shard, "r1", stream=True)], ["r1"], ids_to_bytes([0]), ids_to_bytes([50]), [])])
    out, to_engine = shard.on_steps([StepOutputs([], [], b"", b"", aborted=["r1"])])
    assert out == {} and to_engine == [] and shard.requests == {}


def step(rids, indices, tokens, finished=(), **kw):
    return StepOutputs(kw.pop("started", []), list(rids), ids_to_bytes(indices), ids_to_bytes(tokens),
                       list(finished), **kw)


@pytest.mark.parametrize("stream", [False, True])
def test_one_choice_stopped_by_a_string_leaves_the_others_running(shard, stream):
    """n=3: choice 1 meets the stop string; the shard ends that choice only (EndChoices), and the request
    ends when the engine ends the other two. The old protocol dropped the whole request here and the
    client never got an answer."""
    tok = shard.tokenizer
    river, sea = (tok.encode(w, add_special_tokens=False).ids for w in ("The river runs", " sea"))
    started = start(shard, "r", endpoint="completions", n=3, stop=["sea"], stream=stream)
    out, to_engine = shard.on_steps([step(["r"] * 3, [0, 1, 2], [river[0]] * 3, started=[started])])
    assert to_engine == []
    out, to_engine = shard.on_steps([step(["r"] * 3, [0, 1, 2], [river[1], sea[0], river[1]])])
    assert to_engine == [EndChoices([("r", 1)])] and "r" in shard.requests
    out, _ = shard.on_steps([step(["r", "r"], [0, 2], [river[2], river[2]], [Finished("r", 0, "length")])])
    assert "r" in shard.requests and all(f.done is False for f in out.get("ipc://r", []))
    out, _ = shard.on_steps([step(["r"], [2], [sea[0]], [Finished("r", 2, "length")])])
    final = out["ipc://r"][-1]
    assert final.done and final.error is None and shard.requests == {}
    if stream:
        events = [e for e in sse_events([f.data for f in out["ipc://r"]]) if e != "[DONE]"]
        reasons = {c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]}
        assert reasons == {2: "stop"}
    else:
        choices = {c["index"]: c for c in json.loads(final.data)["choices"]}
        assert {i: c["finish_reason"] for i, c in choices.items()} == {0: "length", 1: "stop", 2: "stop"}
        assert choices[1]["text"] == tok.decode(river[:1] + sea).removesuffix("sea")
        assert choices[2]["text"] == tok.decode(river + sea).removesuffix("sea")


def test_a_request_the_engine_failed_gets_an_error_and_nothing_else(shard):
    started = start(shard, "r", stream=True)
    shard.on_steps([step(["r"], [0], [50], started=[started])])
    out, to_engine = shard.on_steps([step(["r"], [0], [51], failed=[Failed("r", "structured output: boom")])])
    (frame,) = out["ipc://r"]
    assert frame.done and frame.error.status == 500 and to_engine == [] and shard.requests == {}
    assert frame.error.message == "structured output: boom" and frame.data == b""


def test_a_request_that_fails_before_its_first_token_gets_an_error(shard):
    out, _ = shard.on_steps([step([], [], [], started=[start(shard, "r")], failed=[Failed("r", "no grammar")])])
    (frame,) = out["ipc://r"]
    assert frame.done and frame.error.status == 500 and shard.requests == {}


def test_a_failing_request_gets_an_error_and_the_others_go_on(shard, monkeypatch):
    from sluice.postproc.request import RequestOutput

    shard.on_steps([StepOutputs([start(shard, "bad"), start(shard, "good")], [], b"", b"", [])])
    real = RequestOutput.feed

    def explode(self, *args):
        if self.spec.request_id == "bad":
            raise RuntimeError("boom")
        return real(self, *args)

    monkeypatch.setattr(RequestOutput, "feed", explode)
    out, to_engine = shard.on_steps([StepOutputs([], ["bad", "good"], ids_to_bytes([0, 0]), ids_to_bytes([50, 51]),
                                                [Finished("good", 0, "length")])])
    frames = {f.request_id: f for f in out["ipc://r"]}
    assert frames["bad"].error.status == 500 and frames["bad"].error.code == "internal_error"
    assert frames["good"].error is None
    assert json.loads(frames["good"].data)["choices"][0]["finish_reason"] == "length"
    assert to_engine == [Abort(["bad"])] and shard.requests == {}


@pytest.mark.parametrize("interval", [1, 3, 8])
def test_stream_interval_batches_tokens_into_frames(shard, interval):
    text = "The river runs to the sea while the market opens"
    n = len(shard.tokenizer.encode(text, add_special_tokens=False).ids)
    spec_kw = dict(stream=True, stream_interval=interval, return_token_ids=True)
    data, _ = feed(shard, text, started=start(shard, "r1", **spec_kw))
    events = [e for e in sse_events(data) if e != "[DONE]" and e["choices"]]
    content = [e for e in events if e["choices"][0]["delta"].get("content") or e["choices"][0].get("token_ids")]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == text
    sizes = [len(e["choices"][0]["token_ids"]) for e in content]
    assert sum(sizes) == n and sizes[0] == 1  # the first token at once
    assert all(s == interval for s in sizes[1:-1]) and sizes[-1] <= interval


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 6), max_size=30), st.sampled_from(["chat", "completions"]))
def test_steps_handed_over_together_stream_the_same_output_in_fewer_frames(tiny_chat_dir, groups, endpoint):
    """A shard that fell behind gets several steps at once: each request then sends what they hold in one
    chunk. The text, finish reason and usage are the same as one step at a time."""
    text = "The quick brown fox jumps over the lazy dog, then rests by the river until dusk."
    tokenizer = Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json"))
    runs = []
    for g in (None, groups):
        shard = Shard(tokenizer)
        data, _ = feed(shard, text, started=start(shard, "r1", stream=True, include_usage=True, endpoint=endpoint),
                       groups=g)
        events = sse_events(data)
        choices = [e["choices"][0] for e in events[:-2]]
        streamed = "".join(c["delta"].get("content") or "" if endpoint == "chat" else c["text"] for c in choices)
        runs.append((len(data), streamed, choices[-1]["finish_reason"], events[-2]["usage"], events[-1]))
    (frames_alone, *alone), (frames_together, *together) = runs
    assert together == alone and alone[0] == text
    handovers, left = 0, frames_alone  # one frame per step when alone
    for size in itertools.chain(groups, itertools.repeat(1)):
        if left <= 0:
            break
        left, handovers = left - size, handovers + 1
    assert frames_together == handovers


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 600), max_size=12), st.integers(1, 600))
def test_a_backlog_goes_out_in_parts_of_whole_steps_in_order(sizes, bound):
    """Steps are never split nor reordered; a part holds at most `bound` tokens unless it is one step, and two
    neighbouring parts could not have been one."""
    steps = [StepOutputs([], [f"r{i}"] * n, ids_to_bytes([0] * n), ids_to_bytes([0] * n)) for i, n in enumerate(sizes)]
    out = parts(steps, bound)
    assert [s for part in out for s in part] == steps
    tokens = [sum(len(s.request_ids) for s in part) for part in out]
    assert all(t <= bound or len(part) == 1 for t, part in zip(tokens, out))
    assert all(a + len(b[0].request_ids) > bound for a, b in zip(tokens, out[1:]))
