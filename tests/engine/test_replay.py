"""The replay runner: recorded outputs in arrival order, or seeded random ids."""
from __future__ import annotations

import numpy as np

from sluice.engine.replay import ReplayRunner
from sluice.engine.sampler import uniform_from
from sluice.engine.scheduler import ScheduledBatch
from tests.engine.helpers import seq


def _batch(seqs, prefilling=()):
    """A step in which every sequence but those in `prefilling` samples its next token."""
    for s in seqs:
        s.num_computed_tokens = len(s.token_ids) - 1 - (4 if s in prefilling else 0)
    return ScheduledBatch(seqs, [1] * len(seqs))


def test_random_ids_are_each_rows_own_seeded_draw_and_skip_rows_that_do_not_sample():
    seqs = [seq(f"r{i}", [1] * 8, seed=1000 + i) for i in range(5)]
    for i, s in enumerate(seqs):
        s.token_ids += [9] * i  # each at a step of its own
    skipped = seqs[1]
    tokens = ReplayRunner(50_000).run(_batch(seqs, prefilling=[skipped])).tokens
    want = [int(uniform_from(np.array([s.seed], np.uint64), np.array([len(s.token_ids) - 8], np.uint64))[0] * 50_000)
            for s in seqs if s is not skipped]
    assert tokens == want and len(set(tokens)) == 4
    assert ReplayRunner(50_000).run(_batch(seqs, prefilling=[skipped])).tokens == tokens


def test_recordings_go_to_requests_in_arrival_order_then_end_with_a_stop_token():
    runner = ReplayRunner(100, [[10, 11, 12], [20, 21]])
    a = seq("a", [1], max_tokens=8, stop_token_ids=(99,))
    b = seq("b", [1], max_tokens=8)
    c = seq("c", [1], max_tokens=1)
    outputs = {s.request_id: [] for s in (a, b, c)}
    for _ in range(4):
        live = [s for s in (a, b, c) if len(outputs[s.request_id]) < s.sampling.max_tokens]
        for s, token in zip(live, runner.run(_batch(live)).tokens):
            s.token_ids.append(token)
            outputs[s.request_id].append(token)
    assert outputs == {"a": [10, 11, 12, 99], "b": [20, 21, 0, 0], "c": [10]}
    assert runner._assigned == {}  # every recording ran out or reached max_tokens: none is held
