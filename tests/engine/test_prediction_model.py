"""Predicted outputs as a speculative draft on the real tiny model: greedy output with any prediction is the
output without one, token for token (batched, preempted), and a seeded request samples the same tokens with
the same logprobs."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.engine.block_manager import BlockManager
from sluice.engine.prediction import Prediction
from sluice.engine.scheduler import Scheduler
from tests.engine.helpers import make_engine, seq
from tests.engine.test_prediction import mutated


@pytest.fixture(scope="module")
def runner(tiny_chat_dir):
    return make_engine(tiny_chat_dir, num_blocks=256)[0]


def _generate(runner, requests, *, draft_tokens=8, num_blocks=256, budget=2048):
    """Runs `requests` ((prompt, prediction or None, sampling kwargs)) together, in a cache of `num_blocks`:
    their outputs, logprobs, sequences and the scheduler."""
    sched = Scheduler(BlockManager(num_blocks, runner.block_size), max_num_seqs=64, max_num_batched_tokens=budget,
                      max_model_len=4096, max_draft_tokens=draft_tokens)
    seqs = []
    for i, (prompt, prediction, kw) in enumerate(requests):
        s = seq(f"r{i}", prompt, **kw)
        if prediction is not None:
            s.prediction = Prediction(prediction)
        seqs.append(s)
        sched.add(s)
    out: dict[str, list[int]] = {s.request_id: [] for s in seqs}
    lps: dict[str, list] = {s.request_id: [] for s in seqs}
    while (batch := sched.schedule()) is not None:
        samples = runner.run(batch)
        result = sched.update(batch, samples.tokens, samples.counts)
        entries = samples.logprobs or [None] * len(samples.tokens)
        for (s, tok), lp in zip(result.new_tokens, entries, strict=True):
            out[s.request_id].append(tok)
            lps[s.request_id].append(lp)
    assert len(sched) == 0 and sched.bm.num_free == num_blocks
    return [out[s.request_id] for s in seqs], [lps[s.request_id] for s in seqs], seqs, sched


PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 140)), [7] * 3, list(range(500, 517))]


@pytest.fixture(scope="module")
def reference(runner):
    """Each prompt's greedy output alone, without a prediction."""
    return [_generate(runner, [(p, None, dict(max_tokens=24))])[0][0] for p in PROMPTS]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_greedy_output_with_any_prediction_is_the_output_without_it_batched(runner, reference, data):
    requests = [(p, mutated(ref, data) if data.draw(st.booleans()) else None, dict(max_tokens=24))
                for p, ref in zip(PROMPTS, reference)]
    outputs, _, _, _ = _generate(runner, requests, draft_tokens=data.draw(st.integers(1, 8)))
    assert outputs == reference


def test_its_own_output_as_the_prediction_is_accepted_and_takes_fewer_steps(runner, reference):
    outputs, _, seqs, _ = _generate(runner, [(PROMPTS[0], reference[0], dict(max_tokens=24))], draft_tokens=8)
    assert outputs == [reference[0]]
    # after the first token: 8 drafted and 1 more a step, twice, then 4 and 1 (max_tokens)
    assert (seqs[0].prediction.accepted, seqs[0].prediction.rejected) == (8 + 8 + 4, 0)


def test_seeded_sampling_and_logprobs_are_the_same_with_a_prediction(runner):
    kw = dict(max_tokens=20, temperature=0.9, seed=11, logprobs=2)
    (alone,), (lps,), _, _ = _generate(runner, [(PROMPTS[1], None, kw)])
    counts = []
    for prediction in (alone, alone[:5] + [3, 3] + alone[5:], [9] * 30):
        (out, _), (drafted, _), (s, _), _ = _generate(runner, [(PROMPTS[1], prediction, kw), (PROMPTS[0], None, kw)])
        assert out == alone
        for a, b in zip(lps, drafted, strict=True):
            assert a.top_ids == b.top_ids and a.rank == b.rank
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        counts.append((s.prediction.accepted, s.prediction.rejected))
    # after the first token, 8 drafted and 1 more a step, twice; the 20th comes alone (max_tokens)
    assert counts[0] == (8 + 8, 0)
    assert counts[1][0] > 0 and counts[1][1] > 0


def test_preempted_drafted_sequences_recompute_to_the_same_output(runner, reference):
    requests = [(p, ref, dict(max_tokens=24)) for p, ref in zip(PROMPTS, reference)]
    # 4 blocks of 16 tokens: the longest alone fills them
    outputs, _, _, sched = _generate(runner, requests, num_blocks=4, budget=64)
    assert outputs == reference and sched.stats.num_preemptions > 0


def test_a_model_with_sliding_window_layers_beside_full_ones_drafts_to_the_same_output():
    """tiny-gpt-oss: the window layers (a window of 8) keep their KV in a pool of its own, which a draft's blocks
    come from too."""
    from sluice.app.builtin_models import ensure_builtin

    path = ensure_builtin("tiny-gpt-oss")
    prompts = [list(range(200, 230)), [5, 6, 7]]
    runner, _ = make_engine(path, num_blocks=64)
    assert runner.hybrid
    outputs = []
    for predictions in ([None, None], "own", "edited"):
        sched = Scheduler(BlockManager(64, runner.block_size), max_num_seqs=64, max_num_batched_tokens=2048,
                          max_model_len=4096, sliding_window=runner.sliding_window,
                          window_pool=BlockManager(64, runner.block_size, table="window_table"))
        seqs = [seq(f"r{i}", p, max_tokens=24) for i, p in enumerate(prompts)]
        if predictions == "own":
            for s, out in zip(seqs, outputs[0]):
                s.prediction = Prediction(out)
        elif predictions == "edited":
            for s, out in zip(seqs, outputs[0]):
                s.prediction = Prediction(out[:10] + [1, 2] + out[13:])
        for s in seqs:
            sched.add(s)
        got: dict[str, list[int]] = {s.request_id: [] for s in seqs}
        while (batch := sched.schedule()) is not None:
            samples = runner.run(batch)
            for s, tok in sched.update(batch, samples.tokens, samples.counts).new_tokens:
                got[s.request_id].append(tok)
        assert sched.bm.num_free == 64 and sched.window_pool.num_free == 64
        outputs.append([got[s.request_id] for s in seqs])
        if predictions != [None, None]:
            assert sum(s.prediction.accepted for s in seqs) > 0
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
