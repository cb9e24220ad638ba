"""The router's KV index and choice, without processes: it hashes prompts as the engines do, follows their
block events, prefers the worker holding the longest prefix, and lets load decide when it is skewed."""
from __future__ import annotations

import msgspec
import zmq
from hypothesis import given
from hypothesis import strategies as st

from sluice.engine.block_manager import BlockManager
from sluice.engine.kv_events import KvEventPublisher
from sluice.engine.sequence import Sequence
from sluice.ipc.kv import KvEvents, block_hashes
from sluice.ipc.messages import SamplingParams
from sluice.router.policy import KvIndex, Load, Policy


@given(st.lists(st.integers(0, 1000), max_size=80), st.text(max_size=8), st.sampled_from([1, 4, 16]))
def test_the_router_hashes_prompts_as_the_engine_does(ids, salt, block_size):
    seq = Sequence("r", ids, SamplingParams(max_tokens=1), seed=0, cache_salt=salt)
    bm = BlockManager(4, block_size)
    assert block_hashes(ids, salt, block_size) == [bm._hash(seq, i) for i in range(len(ids) // block_size)]


def test_the_index_follows_snapshots_and_events():
    index = KvIndex()
    a = block_hashes(list(range(64)), "", 16)
    index.apply("w1", KvEvents(0, a[:2], snapshot=True))
    assert index.overlap("w1", a) == 2 and index.overlap("w2", a) == 0
    index.apply("w1", KvEvents(1, a[2:], [a[1]]))
    assert index.overlap("w1", a) == 1  # a prefix ends at the first block it does not hold
    index.apply("w1", KvEvents(2, [a[0]], snapshot=True))
    assert index.held["w1"] == {a[0]}
    index.clear("w1")
    assert index.overlap("w1", a) == 0


def test_the_longest_cached_prefix_wins_unless_load_is_skewed():
    index, policy = KvIndex(), Policy()
    a = block_hashes(list(range(160)), "", 16)
    index.apply("w2", KvEvents(0, a[:8], snapshot=True))
    loads = {"w1": Load(), "w2": Load()}
    assert policy.choose(["w1", "w2"], a, index, loads).worker == "w2"
    assert policy.choose(["w1", "w2"], a, index, loads).overlap == 8
    loads["w2"] = Load(in_flight=40, blocks=40)  # 40 requests against none: the balance guard
    choice = policy.choose(["w1", "w2"], a, index, loads)
    assert (choice.worker, choice.reason) == ("w1", "balance")
    turns = {Policy("round_robin").choose(["w1", "w2"], a, index, {}).worker for _ in range(2)}
    assert len(turns) == 1  # (a fresh policy starts at the first worker)


def test_the_engine_publishes_a_snapshot_to_each_new_subscriber():
    ctx = zmq.Context.instance()
    bm = BlockManager(8, 4)
    pub = KvEventPublisher(ctx, "inproc://kv-events-test", bm)
    sub = ctx.socket(zmq.SUB)
    sub.connect("inproc://kv-events-test")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    seq = Sequence("r", list(range(9)), SamplingParams(max_tokens=1), seed=0)
    bm.allocate(seq, 9)
    seq.num_computed_tokens = 9
    bm.register_full_blocks(seq)
    decode = msgspec.msgpack.Decoder(KvEvents).decode
    assert bm.events is None  # nobody subscribed yet: nothing is recorded
    for _ in range(100):
        pub.publish()
        if sub.poll(10):
            first = decode(sub.recv())
            break
    assert first.snapshot and set(first.stored) == set(bm.cached) and len(first.stored) == 2
    assert bm.events is pub.events
    bm.deallocate(seq)
    other = Sequence("s", list(range(100, 132)), SamplingParams(max_tokens=1), seed=0)
    bm.allocate(other, 32)  # takes every free block: the cached ones are evicted
    pub.publish()
    evicted = decode(sub.recv())
    assert evicted.seq == first.seq + 1 and set(evicted.removed) == set(first.stored)
    pub.close()
    sub.close()


@given(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=20, unique=True))
def test_a_prompt_cache_key_keeps_its_requests_on_one_worker_where_the_cache_leaves_a_choice(keys):
    index, workers = KvIndex(), ["w1", "w2", "w3"]
    policy = Policy()
    for key in keys:
        first = policy.choose(workers, [], index, {}, affinity=key).worker
        assert all(policy.choose(workers, [], index, {}, affinity=key).worker == first for _ in range(4))
        assert policy.choose(workers[::-1], [], index, {}, affinity=key).worker == first  # (whatever the order)
    rr = Policy("round_robin")
    assert len({rr.choose(workers, [], index, {}, affinity=keys[0]).worker for _ in range(6)}) == 1


def test_the_cache_and_a_skewed_load_still_win_over_a_prompt_cache_key():
    index, policy, workers = KvIndex(), Policy(), ["w1", "w2"]
    a = block_hashes(list(range(160)), "", 16)
    key = next(k for k in map(str, range(100)) if policy.choose(workers, [], index, {}, affinity=k).worker == "w1")
    index.apply("w2", KvEvents(0, a, snapshot=True))
    assert policy.choose(workers, a, index, {}, affinity=key).worker == "w2"  # w2 holds the prompt
    skewed = {"w1": Load(in_flight=40), "w2": Load(in_flight=0)}
    assert policy.choose(workers, [], KvIndex(), skewed, affinity=key).worker == "w2"
    spread = {k for k in map(str, range(40)) if policy.choose(workers, [], KvIndex(), {}, affinity=k).worker == "w2"}
    assert 5 < len(spread) < 35  # keys spread over the workers
