"""The engine's thread count for each batch size's steps (engine/threads.py): the count they measure faster on."""
from __future__ import annotations

import torch

from sluice.engine.engine import cpu_threads
from sluice.engine.threads import ThreadTuner


class Machine:
    """Steps whose seconds depend on the thread count set (`seconds[threads]`, changeable mid-run)."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds = seconds
        self.threads = 2
        self.sets: list[int] = []
        self.steps = {1: 0, 2: 0}

    def set(self, threads: int) -> None:
        self.threads = threads
        self.sets.append(threads)

    def run(self, tuner: ThreadTuner, rows: int, steps: int) -> None:
        """`steps` decode steps of `rows` sequences."""
        for _ in range(steps):
            used = tuner.threads_for(rows)
            assert used == self.threads
            self.steps[used] += 1
            tuner.record(rows, self.seconds[used])


def test_a_step_moves_to_one_thread_when_one_runs_it_faster() -> None:
    m = Machine({2: 0.040, 1: 0.012})  # two threads stalled by a loaded machine
    tuner = ThreadTuner(2, m.set)
    m.run(tuner, 1, 2000)
    assert tuner.choices() == {1: 1}
    # the first period, then probes back after 64, 128, 256 and 512 steps (the next after 1,024), each ended
    # by its first timed step (3x the time)
    assert m.steps[2] == 64 + 2 * 4


def test_a_step_stays_on_every_thread_when_they_run_it_faster_and_probes_grow_rare() -> None:
    m = Machine({2: 0.009, 1: 0.012})
    tuner = ThreadTuner(2, m.set, most_period=512)
    m.run(tuner, 1, 4000)
    assert tuner.choices() == {1: 2}
    # probes of 5 steps after 64, 128, 256, 512, 512, ... steps: a few dozen of 4,000
    assert 5 <= m.steps[1] <= 60


def test_the_choice_follows_the_machine_when_its_load_comes_and_goes() -> None:
    m = Machine({2: 0.009, 1: 0.012})
    tuner = ThreadTuner(2, m.set, most_period=256)
    m.run(tuner, 1, 600)
    assert tuner.choices() == {1: 2}
    m.seconds = {2: 0.050, 1: 0.013}
    m.run(tuner, 1, 600)
    assert tuner.choices() == {1: 1}
    m.seconds = {2: 0.009, 1: 0.012}
    m.run(tuner, 1, 600)
    assert tuner.choices() == {1: 2}


def test_a_probe_within_the_margin_keeps_the_count() -> None:
    m = Machine({2: 0.0100, 1: 0.0098})  # 2% faster: noise, not a reason to move
    tuner = ThreadTuner(2, m.set, margin=0.05)
    m.run(tuner, 1, 1000)
    assert tuner.choices() == {1: 2}


def test_each_kind_of_step_is_tuned_on_its_own() -> None:
    m = Machine({2: 0.030, 1: 0.010})
    tuner = ThreadTuner(2, m.set)
    m.run(tuner, 1, 300)
    m.seconds = {2: 0.010, 1: 0.030}
    m.run(tuner, 16, 300)
    assert tuner.choices() == {1: 1, 16: 2}
    assert tuner.threads_for(1) == 1 and tuner.threads_for(16) == 2


def test_a_probe_ends_at_its_first_step_far_slower_and_loses() -> None:
    m = Machine({2: 0.010, 1: 0.013})  # 1.3x: past _HOPELESS
    tuner = ThreadTuner(2, m.set, first_period=8)
    m.run(tuner, 1, 8 + 2)
    assert m.steps[1] == 2 and tuner.choices() == {1: 2}  # (the step that woke it, then the one timed)
    m.run(tuner, 1, 16)
    assert m.steps[1] == 2  # the next probe after twice the period...
    m.run(tuner, 1, 2)
    assert m.steps[1] == 4


def test_the_flag_sets_torchs_thread_count_or_tunes_from_it() -> None:
    before = torch.get_num_threads()
    try:
        assert cpu_threads("1") is None and torch.get_num_threads() == 1
        torch.set_num_threads(2)
        tuner = cpu_threads("auto")
        assert tuner is not None and tuner.most == 2
        torch.set_num_threads(1)
        assert cpu_threads("auto") is None  # one core: nothing to choose
    finally:
        torch.set_num_threads(before)
