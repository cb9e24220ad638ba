"""Codec round trips, inline and through the shared-memory ring."""
from __future__ import annotations

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.ipc.messages import (Abort, ControlInput, Drain, DrainTimedOut, EndChoices, EngineDied, EngineInput,
                                 EngineRequest, Failed, Finished, Frame, Frames, IngressInput, Logprobs, Rendered,
                                 SamplingParams, StageDied, Started, StepOutputs, bytes_to_ids, ids_to_bytes)
from sluice.ipc.shm import ShmRingReader, ShmRingWriter
from sluice.ipc.transport import PullChannel, PushChannel

ids = st.lists(st.integers(0, 2**31 - 1), max_size=300)
sampling = st.builds(SamplingParams, max_tokens=st.integers(1, 10**6), temperature=st.floats(0, 2),
                     top_p=st.floats(0.01, 1), top_k=st.integers(0, 100), seed=st.none() | st.integers(0, 2**63 - 1),
                     stop_token_ids=st.lists(st.integers(0, 10**6), max_size=4).map(tuple),
                     logit_bias=st.dictionaries(st.integers(0, 10**6), st.floats(-100, 100), max_size=3),
                     bad_words_ids=st.lists(st.lists(st.integers(0, 10**6), min_size=1, max_size=3), max_size=2),
                     logprobs=st.none() | st.integers(0, 20))
engine_requests = st.builds(EngineRequest, request_id=st.text(max_size=40), prompt_token_ids=ids.map(ids_to_bytes),
                            sampling=sampling, shard=st.integers(0, 16), postproc_spec=st.binary(max_size=64))
step_outputs = st.builds(
    StepOutputs,
    started=st.lists(st.builds(Started, request_id=st.text(max_size=10), postproc_spec=st.binary(max_size=20),
                               num_prompt_tokens=st.integers(0, 10**6)), max_size=3),
    request_ids=st.lists(st.text(max_size=10), max_size=5),
    indices=ids.map(ids_to_bytes),
    token_ids=ids.map(ids_to_bytes),
    finished=st.lists(st.builds(Finished, st.text(max_size=10), st.integers(0, 8),
                                st.sampled_from(["stop_token", "grammar", "length"])),
                      max_size=3),
    aborted=st.lists(st.text(max_size=10), max_size=3),
    failed=st.lists(st.builds(Failed, st.text(max_size=10), st.text(max_size=30)), max_size=2),
    logprobs=st.lists(st.tuples(st.integers(0, 5), st.builds(Logprobs, st.binary(max_size=8), st.binary(max_size=8),
                                                              st.binary(max_size=8), st.binary(max_size=8),
                                                              st.integers(0, 20))), max_size=2),
)


@given(msg=engine_requests | st.builds(Abort, st.lists(st.text(max_size=20), max_size=5))
       | st.builds(EndChoices, st.lists(st.tuples(st.text(max_size=20), st.integers(0, 127)), max_size=5)))
def test_engine_messages_round_trip(msg):
    data = msgspec.msgpack.encode(msg)
    assert msgspec.msgpack.decode(data, type=EngineInput) == msg


@given(msg=st.builds(Drain) | st.builds(EngineDied) | st.builds(DrainTimedOut, st.floats(0, 1e6))
       | st.builds(StageDied, st.sampled_from(["render", "postproc"]), st.integers(0, 64)))
def test_control_events_round_trip(msg):
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=ControlInput) == msg


@given(msg=st.builds(Rendered, st.lists(st.text(max_size=20), max_size=5))
       | st.builds(Frames, st.lists(st.builds(Frame, st.text(max_size=10), st.binary(max_size=20)), max_size=3)))
def test_ingress_messages_round_trip(msg):
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=IngressInput) == msg


def test_a_finish_reason_outside_the_protocol_is_a_decode_error():
    """The old protocol's "abort" verdict with choice -1 meant 'the whole request': a peer still speaking
    it must fail loudly, not be read as something else."""
    old = StepOutputs([], [], b"", b"", [Finished("r", 0, "length")])
    raw = msgspec.msgpack.encode(old).replace(b"\xa6length", b"\xa5abort")
    with pytest.raises(msgspec.ValidationError, match="abort"):
        msgspec.msgpack.decode(raw, type=StepOutputs)


@given(msg=step_outputs)
def test_step_outputs_round_trip(msg):
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=StepOutputs) == msg


@given(values=ids)
def test_token_buffers_round_trip(values):
    assert bytes_to_ids(ids_to_bytes(values)).tolist() == values


@pytest.fixture(scope="module")
def channel(tmp_path_factory):
    """One channel for all examples, so the ring wraps around many times."""
    tmp_path = tmp_path_factory.mktemp("chan")
    ctx = zmq.Context()
    pull = PullChannel(ctx, f"ipc://{tmp_path}/s", IngressInput)
    push = PushChannel(ctx, f"ipc://{tmp_path}/s", shm_dir=str(tmp_path), shm_threshold=256, ring_bytes=4096)
    yield push, pull
    push.close()
    pull.close()
    ctx.term()


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=30))
def test_channel_delivers_every_size_in_order(channel, sizes):
    push, pull = channel
    sent = [Frames([Frame(str(i), bytes([i % 251]) * n, done=bool(i % 2))]) for i, n in enumerate(sizes)]
    for m in sent:
        push.put(m)
    assert [pull.get(timeout=5) for _ in sent] == sent


def test_ring_wraps_and_refuses_when_full(tmp_path):
    w = ShmRingWriter(str(tmp_path), 100)
    r = ShmRingReader(w.path)
    first = w.write(memoryview(b"a" * 60))
    assert first is not None
    assert w.write(memoryview(b"b" * 60)) is None  # unread data still fills the ring
    assert r.read(first[0], 60, first[1]) == b"a" * 60
    second = w.write(memoryview(b"c" * 60))  # wraps to the start
    assert second is not None and r.read(second[0], 60, second[1]) == b"c" * 60
    r.close()
    w.close()
