"""Predicted outputs as a speculative draft (sluice/engine/prediction.py): the draft's bookkeeping, and the
scheduler with an oracle runner (no model): the output with any prediction is the output without one. The real
model's side: test_prediction_model.py."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.engine.block_manager import BlockManager
from sluice.engine.prediction import Prediction, num_accepted, verified
from sluice.engine.scheduler import ScheduledBatch, Scheduler
from tests.engine.helpers import seq


def test_a_draft_keeps_its_matching_run_and_the_token_after_it():
    assert verified([5, 6, 7, 8], [5, 6, 7], ()) == [5, 6, 7, 8]  # all right: the next one too
    assert verified([5, 9, 7, 8], [5, 6, 7], ()) == [5, 9]  # the first the draft did not have ends it
    assert verified([4, 6, 7, 8], [5, 6, 7], ()) == [4]
    assert verified([5, 2, 7, 8], [5, 2, 7], (2,)) == [5, 2]  # nothing after a stop token
    assert verified([3], [], ()) == [3]
    assert num_accepted([5, 9], [5, 6, 7]) == 1 and num_accepted([5, 6, 7, 8], [5, 6, 7]) == 3
    assert num_accepted([5, 2], [5, 2, 7]) == 2 and num_accepted([4], [5]) == 0


def test_the_draft_follows_the_output_and_finds_its_place_again():
    p = Prediction([10, 11, 12, 13, 14, 15, 16])
    out = [1, 2]  # a prompt of 2
    assert p.draft(3) == [10, 11, 12]
    out += [10, 11]
    p.advance(out, 2, 2)
    assert p.draft(2) == [12, 13]
    out += [99]  # an insertion: lost...
    p.advance(out, 2, 1)
    assert p.draft(2) == []
    out += [12]  # ...and found where the output comes back to it
    p.advance(out, 2, 1)
    assert p.draft(2) == [13, 14]
    out += [15]  # a deletion (13, 14 skipped): found ahead
    p.advance(out, 2, 1)
    assert p.draft(9) == [16]
    out += [16]
    p.advance(out, 2, 1)
    assert p.draft(4) == []  # the prediction is used up


def test_a_realignment_backwards_needs_a_longer_match():
    p = Prediction([1, 2, 3, 7, 8, 9, 7, 5])
    out = [0, 1, 2, 3, 7, 8, 9]
    p.advance(out, 1, 6)
    assert p.draft(1) == [7]
    out += [2]  # 2 sits behind, matched by one token only: not taken
    p.advance(out, 1, 1)
    assert p.draft(1) == []
    out += [3, 7]  # (2, 3, 7): three tokens back
    p.advance(out, 1, 2)
    assert p.draft(2) == [8, 9]


def test_far_ahead_one_matching_token_is_not_enough():
    p = Prediction(list(range(100, 130)))
    out = [0, 100]
    p.advance(out, 1, 1)
    out += [125]  # 125 sits 24 ahead: one token is no evidence
    p.advance(out, 1, 1)
    assert p.draft(2) == []
    out += [126]  # (125, 126): two are
    p.advance(out, 1, 1)
    assert p.draft(2) == [127, 128]


def test_a_missed_draft_shortens_the_next_and_a_kept_one_doubles_it():
    p = Prediction(list(range(100)))
    assert len(p.draft(8)) == 8
    p.verified(0, 8)  # none kept: the next draft is one token
    assert len(p.draft(8)) == 1
    p.verified(1, 1)
    assert len(p.draft(8)) == 2
    p.verified(2, 2)
    p.verified(4, 4)
    assert len(p.draft(8)) == 8
    p.verified(3, 8)  # 3 kept: 4 next
    assert len(p.draft(8)) == 4
    assert (p.accepted, p.rejected) == (10, 13)


# ---- the scheduler, with an oracle runner ------------------------------------------------------------------

def _oracle_run(batch: ScheduledBatch, targets: dict[str, list[int]]) -> tuple[list[int], list[int]]:
    """What a model whose output is `targets[request]` samples in a step (drafted rows as the runner keeps
    them): (tokens, counts)."""
    tokens, counts = [], []
    for i, s in enumerate(batch.seqs):
        if not batch.samples(i):
            continue
        draft = batch.drafts[i] if batch.drafts else []
        out = s.num_output_tokens
        rows = [targets[s.request_id][out + j] for j in range(len(draft) + 1)]
        kept = verified(rows, draft, s.sampling.stop_token_ids)
        tokens += kept
        counts.append(len(kept))
    return tokens, counts


def _drive(sched: Scheduler, seqs, targets) -> dict[str, list[int]]:
    for s in seqs:
        sched.add(s)
    outputs: dict[str, list[int]] = {s.request_id: [] for s in seqs}
    for _ in range(10_000):
        batch = sched.schedule()
        if batch is None:
            break
        assert sum(batch.num_new_tokens) <= sched.max_step_tokens
        tokens, counts = _oracle_run(batch, targets)
        for s, tok in sched.update(batch, tokens, counts).new_tokens:
            outputs[s.request_id].append(tok)
    assert len(sched) == 0
    return outputs


def mutated(target: list[int], data) -> list[int]:
    """A prediction from the target: itself, changed here and there, cut, lengthened, empty or unrelated."""
    kind = data.draw(st.sampled_from(["same", "edits", "cut", "longer", "empty", "other"]))
    if kind == "same":
        return list(target)
    if kind == "cut":
        return target[: data.draw(st.integers(0, len(target)))]
    if kind == "longer":
        return target + data.draw(st.lists(st.integers(0, 20), max_size=10))
    if kind == "empty":
        return []
    if kind == "other":
        return data.draw(st.lists(st.integers(0, 20), max_size=40))
    out = list(target)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(out)))
        op = data.draw(st.sampled_from(["insert", "delete", "change"]))
        if op == "insert":
            out[i:i] = data.draw(st.lists(st.integers(0, 20), min_size=1, max_size=3))
        elif out and i < len(out):
            if op == "delete":
                del out[i : i + data.draw(st.integers(1, 3))]
            else:
                out[i] = data.draw(st.integers(0, 20))
    return out


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_prediction_leaves_the_output_as_it_is_and_frees_everything(data):
    n = data.draw(st.integers(1, 5))
    num_blocks = data.draw(st.integers(10, 40))
    sched = Scheduler(BlockManager(num_blocks, 4), max_num_seqs=data.draw(st.integers(1, 6)),
                      max_num_batched_tokens=data.draw(st.integers(2, 40)), max_model_len=num_blocks * 4,
                      max_draft_tokens=data.draw(st.integers(0, 8)))
    seqs, targets = [], {}
    for i in range(n):
        prompt = data.draw(st.lists(st.integers(0, 20), min_size=1, max_size=12))
        max_tokens = data.draw(st.integers(1, 24))
        target = data.draw(st.lists(st.integers(0, 20), min_size=max_tokens + 8, max_size=max_tokens + 8))
        s = seq(f"r{i}", prompt, max_tokens=max_tokens, stop_token_ids=data.draw(st.sampled_from([(), (3,)])),
                min_tokens=data.draw(st.integers(0, 3)))
        targets[s.request_id] = target
        if data.draw(st.booleans()):
            s.prediction = Prediction(mutated(target, data))
        seqs.append(s)
    outputs = _drive(sched, seqs, targets)
    for s in seqs:
        expected = targets[s.request_id][: s.sampling.max_tokens]
        stop = s.sampling.stop_token_ids
        for j, tok in enumerate(expected):
            if tok in stop and j + 1 > s.sampling.min_tokens:
                expected = expected[: j + 1]
                break
        assert outputs[s.request_id] == expected
        if s.prediction is not None:
            assert s.prediction.accepted <= len(expected)
    assert sched.bm.num_free == num_blocks


def test_a_right_prediction_takes_several_tokens_a_step_and_counts_them():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                      max_draft_tokens=4)
    target = list(range(1, 40))
    s = seq("a", [0, 0, 0], max_tokens=20)
    s.prediction = Prediction(target[:20])
    sched.add(s)
    steps = 0
    out: list[int] = []
    while (batch := sched.schedule()) is not None:
        steps += 1
        tokens, counts = _oracle_run(batch, {"a": target})
        result = sched.update(batch, tokens, counts)
        out += [t for _, t in result.new_tokens]
        if batch.drafts:
            assert batch.num_new_tokens == [5] or s.status.name == "FINISHED"
    assert out == target[:20]
    assert steps == 1 + 4  # the prompt's step (the first token), then 5 tokens a step (4 drafted + 1)
    # 4 drafted tokens kept a step, then 3 (max_tokens); the token sampled after each run is no draft token
    assert (s.prediction.accepted, s.prediction.rejected) == (4 + 4 + 4 + 3, 0)


def test_a_draft_takes_only_free_blocks_and_never_preempts():
    sched = Scheduler(BlockManager(3, 4), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=12,
                      max_draft_tokens=8)
    a, b = seq("a", [0] * 7, max_tokens=4), seq("b", [0] * 3, max_tokens=4)
    a.prediction = Prediction([1, 2, 3, 4])
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()  # both prompts: a holds 2 blocks, b the third
    sched.update(batch, [1, 9])
    batch = sched.schedule()  # a has room for 1 more token and no block is free: no draft
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 1] and not (batch.drafts and batch.drafts[0])
    assert sched.stats.num_preemptions == 0
