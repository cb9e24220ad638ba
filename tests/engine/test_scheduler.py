"""The scheduler with fake model outputs: no model, no torch."""
from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.engine.block_manager import BlockManager
from sluice.engine.scheduler import Scheduler
from tests.engine.helpers import seq


def make(num_blocks=64, block_size=4, budget=32, max_num_seqs=8, max_model_len=1000):
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, max_model_len=max_model_len)


def run(sched, fake_token=7, max_steps=10_000, on_step=None):
    """Drives the scheduler with a fake runner; returns outputs and per-step batches."""
    outputs, steps = {}, []
    for _ in range(max_steps):
        batch = sched.schedule()
        if batch is None:
            break
        assert sum(batch.num_new_tokens) <= sched.max_step_tokens
        steps.append([(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)])
        sampled = [fake_token for i in range(len(batch.seqs)) if batch.samples(i)]
        result = sched.update(batch, sampled)
        for s, tok in result.new_tokens:
            outputs.setdefault(s.request_id, []).append(tok)
        if on_step:
            on_step(len(steps), result)
    return outputs, steps


def test_continuous_batching_joins_and_leaves():
    sched = make()
    sched.add(seq("a", [1] * 4, max_tokens=3))
    sched.add(seq("b", [1] * 4, max_tokens=6))
    added = []

    def on_step(step, result):
        if step == 2:
            sched.add(seq("c", [1] * 4, max_tokens=2))
            added.append(step)

    outputs, steps = run(sched, on_step=on_step)
    assert {k: len(v) for k, v in outputs.items()} == {"a": 3, "b": 6, "c": 2}
    assert ("c", 4) in steps[2] and ("b", 1) in steps[2]  # c's prefill joined b's decode
    assert all(rid != "a" for rid, _ in steps[3])  # a left after its third token
    assert sched.bm.num_free == sched.bm.num_blocks and len(sched) == 0


def test_chunked_prefill_shares_budget_with_decodes_first():
    sched = make(budget=8, num_blocks=256)
    sched.add(seq("short", [1] * 2, max_tokens=10))

    def on_step(step, result):
        if step == 1:
            sched.add(seq("long", [1] * 40, max_tokens=2))

    outputs, steps = run(sched, on_step=on_step)
    for step in steps[1:6]:
        ids = dict(step)
        assert ids.get("short") == 1  # the running decode is served every step
        assert ids.get("long", 0) <= 7
    assert len(outputs["long"]) == 2 and len(outputs["short"]) == 10


def test_a_prompts_small_tail_joins_its_last_full_chunk():
    """A prompt whose last chunk would be an eighth of the budget or less takes it one step early, over the
    budget by at most that; a longer remainder gets a step of its own, and a sliding window keeps the budget."""
    sched = make(budget=64, num_blocks=256)
    sched.add(seq("tail", [1] * 72, max_tokens=1))
    sched.add(seq("rest", [2] * 73, max_tokens=1))
    _, steps = run(sched)
    assert steps[0] == [("tail", 72)]
    assert steps[1:3] == [[("rest", 64)], [("rest", 9)]]
    windowed = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1000,
                         sliding_window=32)
    windowed.add(seq("tail", [1] * 72, max_tokens=1))
    assert run(windowed)[1][:2] == [[("tail", 64)], [("tail", 8)]]


def test_stop_tokens_min_tokens_and_length():
    sched = make()
    sched.add(seq("stops", [1] * 3, max_tokens=10, stop_token_ids=(7,)))
    sched.add(seq("min", [1] * 3, max_tokens=10, stop_token_ids=(7,), min_tokens=4))
    sched.add(seq("len", [1] * 3, max_tokens=5))
    finished = {}
    run(sched, on_step=lambda i, r: finished.update({s.request_id: (why, s.num_output_tokens)
                                                     for s, why in r.finished}))
    assert finished == {"stops": ("stop_token", 1), "min": ("stop_token", 5), "len": ("length", 5)}


def test_max_model_len_ends_with_length():
    sched = make(max_model_len=10)
    sched.add(seq("a", [1] * 6, max_tokens=100))
    outputs, _ = run(sched)
    assert len(outputs["a"]) == 4


def test_abort_frees_blocks_waiting_and_running():
    sched = make(max_num_seqs=1)
    sched.add(seq("run", [1] * 8, max_tokens=100))
    sched.add(seq("wait", [1] * 8, max_tokens=100))
    batch = sched.schedule()
    sched.update(batch, [7])
    assert sched.abort("wait") and sched.abort("run")
    assert sched.abort("missing") == []
    assert sched.bm.num_free == sched.bm.num_blocks and len(sched) == 0 and sched.schedule() is None


def test_preemption_recomputes_and_completes_everything():
    # 6 blocks of 4 tokens: three sequences growing to 12 tokens cannot all fit.
    sched = make(num_blocks=6, block_size=4, budget=64)
    for i in range(3):
        sched.add(seq(f"s{i}", [1] * 4, max_tokens=8))
    outputs, steps = run(sched)
    assert sched.stats.num_preemptions > 0
    assert all(len(outputs[f"s{i}"]) == 8 for i in range(3))
    assert sched.bm.num_free == 6


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 30), min_size=1, max_size=8),
    max_tokens=st.integers(1, 12),
    num_blocks=st.integers(8, 40),
    budget=st.integers(1, 48),
    max_num_seqs=st.integers(1, 6),
)
def test_every_request_completes_and_frees_everything(prompts, max_tokens, num_blocks, budget, max_num_seqs):
    block_size = 4
    max_len = max(prompts) + max_tokens
    if -(-max_len // block_size) > num_blocks:
        num_blocks = -(-max_len // block_size)  # the engine refuses to start with less
    sched = make(num_blocks=num_blocks, block_size=block_size, budget=budget, max_num_seqs=max_num_seqs)
    counter = itertools.count()
    for n in prompts:
        sched.add(seq(f"r{next(counter)}", [1] * n, max_tokens=max_tokens))
    outputs, _ = run(sched)
    assert {k: len(v) for k, v in outputs.items()} == {f"r{i}": max_tokens for i in range(len(prompts))}
    assert sched.bm.num_free == num_blocks and len(sched) == 0


def test_priority_orders_admission():
    sched = make(max_num_seqs=1)
    sched.add(seq("late-low", [1] * 4, max_tokens=1, priority=5))
    sched.add(seq("high", [1] * 4, max_tokens=1, priority=-1))
    sched.add(seq("normal", [1] * 4, max_tokens=1))
    _, steps = run(sched)
    assert [s[0][0] for s in steps] == ["high", "normal", "late-low"]


def test_preemption_takes_the_lowest_priority_first():
    # 4 blocks of 4 tokens; two sequences that each grow to 8 tokens cannot both stay.
    sched = make(num_blocks=3, block_size=4, budget=64)
    important = seq("important", [1] * 3, max_tokens=5, priority=-1)
    casual = seq("casual", [1] * 3, max_tokens=5, priority=1)
    sched.add(casual)
    sched.add(important)
    preempted = []
    orig = sched._preempt
    sched._preempt = lambda s: (preempted.append(s.request_id), orig(s))
    outputs, _ = run(sched)
    assert preempted and set(preempted) == {"casual"}
    assert len(outputs["important"]) == 5 and len(outputs["casual"]) == 5


def test_a_waiting_high_priority_request_preempts_a_running_low_one():
    sched = make(num_blocks=2, block_size=4, budget=64)
    sched.add(seq("low", [1] * 6, max_tokens=2, priority=9))
    batch = sched.schedule()
    sched.update(batch, [7])
    sched.add(seq("urgent", [1] * 6, max_tokens=2, priority=0))
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["urgent"] and sched.waiting[0].request_id == "low"


def test_prefix_cache_hits_salts_and_choice_deferral():
    sched = make(num_blocks=64, block_size=4, budget=64)
    prompt = list(range(10, 30))  # 20 tokens: 4 full blocks reusable (the last token is always computed)
    first = seq("a", prompt, max_tokens=2)
    sched.add(first)
    run(sched)
    assert first.num_cached_tokens == 0
    again = seq("b", prompt + [99], max_tokens=2)
    salted = seq("c", prompt, max_tokens=2)
    salted.cache_salt = "tenant"
    sched.add(again)
    sched.add(salted)
    run(sched)
    assert again.num_cached_tokens == 20 and salted.num_cached_tokens == 0
    assert sched.stats.prefix_hits == 20 and sched.stats.prefix_queries == 20 + 21 + 20

    leader = seq("n", list(range(50, 70)), max_tokens=2)
    child = seq("n", list(range(50, 70)), max_tokens=2)
    child.index, child.leader = 1, leader
    sched.add(leader)
    sched.add(child)
    batch = sched.schedule()
    assert [s.index for s in batch.seqs] == [0]  # the child waits for the leader's prompt to be cached
    sched.update(batch, [7])
    batch = sched.schedule()
    assert child in batch.seqs and child.num_cached_tokens == 16


@settings(max_examples=80, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 30), min_size=1, max_size=8),
    max_tokens=st.integers(1, 12),
    window=st.integers(2, 9),
    budget=st.integers(1, 24),
    window_blocks=st.integers(0, 30),
    own_pool=st.booleans(),
    caching=st.booleans(),
)
def test_a_window_frees_as_it_goes_and_everything_completes(prompts, max_tokens, window, budget, window_blocks,
                                                            own_pool, caching):
    """With the window layers' KV in a pool of their own or with every layer windowed in the one pool, with
    the prefix cache or without (prompts of one repeated id: most are found there)."""
    block_size = 4
    longest = max(prompts) + max_tokens
    main_blocks = -(-longest // block_size) * 2
    window_blocks = max(window_blocks, -(-(window - 1 + budget) // block_size) + 1)  # one sequence must fit
    pool = BlockManager(window_blocks, block_size, caching, "window_table") if own_pool else None
    sched = Scheduler(BlockManager(main_blocks, block_size, caching), max_num_seqs=4, max_num_batched_tokens=budget,
                      max_model_len=1000, sliding_window=window, window_pool=pool)
    for i, n in enumerate(prompts):
        sched.add(seq(f"r{i}", [1] * n, max_tokens=max_tokens))

    def on_step(step, result):
        assert sched.running == sorted(sched.running, key=lambda s: s.order)
        for s in sched.running:
            table = s.window_table if own_pool else s.block_table
            held = [b for b in table if b >= 0]
            assert table == [-1] * (len(table) - len(held)) + held  # what the window passed is freed in order
            if own_pool or not caching:  # (the one pool's prefix hits cover a whole prompt until its next step)
                assert len(held) <= -(-(window - 1 + budget) // block_size) + 1  # only what the window reaches
            if caching:  # every full block is in the prefix cache, in both pools
                registered = s.num_registered_window_blocks if own_pool else s.num_registered_blocks
                assert s.num_registered_blocks == registered == s.num_computed_tokens // block_size

    outputs, _ = run(sched, on_step=on_step)
    assert {k: len(v) for k, v in outputs.items()} == {f"r{i}": max_tokens for i in range(len(prompts))}
    assert (pool is None or pool.num_free == window_blocks) and sched.bm.num_free == main_blocks and len(sched) == 0
