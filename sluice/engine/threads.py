"""How many threads the engine's CPU kernels run a step on (--cpu-threads auto): every core it may use, or one,
whichever this machine runs such steps faster on now.

A step's kernels run in lock-step across their threads (a barrier after each linear of each layer). Where other
processes want the cores too (the server's own front stages at every token, a benchmark's client, anything else on
a shared machine), a preempted thread stalls the others at every barrier: there two threads can take several times
one thread's time, swinging with the load, while on an idle machine two threads are faster. So the engine measures
instead of guessing: the decode steps of each batch size run on the count they last found faster, and now and then
a few on the other; the faster median wins. A probe that loses waits twice as long before the next (up to
most_period steps of that size), and one whose step is far slower ends there, so a settled choice costs little.
A step with prompt chunks runs on its batch size's count, unmeasured (its time depends on its prompts).
"""
from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("sluice.engine")
_HOPELESS = 1.25  # a probe's step this many times the slowest of the chosen count's last ones: the probe lost


@dataclass
class _Choice:
    """One batch size's count, its last decode steps' seconds on it, and the probe of the other count."""

    threads: int
    recent: deque[float]
    countdown: int  # steps on `threads` until the next probe
    period: int  # steps between probes (doubles after each probe the chosen count wins)
    probe: list[float] = field(default_factory=list)
    probing: bool = False


class ThreadTuner:
    def __init__(self, most: int, set_threads: Callable[[int], None], probe_steps: int = 4, first_period: int = 64,
                 most_period: int = 1024, margin: float = 0.05) -> None:
        """`most`: every core's thread count (where each batch size starts); `set_threads`: sets the kernels'
        count (torch.set_num_threads, which the C kernels' OpenMP reads too). A probe is `probe_steps` steps
        after one that warms the other count's threads up (not counted); it wins when its median is `margin`
        faster."""
        self.most, self._set = most, set_threads
        self.probe_steps, self.first_period, self.most_period, self.margin = probe_steps, first_period, most_period, \
            margin
        self._choices: dict[int, _Choice] = {}
        self._current = most

    def threads_for(self, rows: int) -> int:
        """Sets and returns the count for a step of `rows` sequences."""
        c = self._choice(rows)
        threads = self._other(c.threads) if c.probing else c.threads
        if threads != self._current:
            self._set(threads)
            self._current = threads
        return threads

    def record(self, rows: int, seconds: float) -> None:
        """A decode step of `rows` sequences took `seconds` on the count threads_for(rows) set."""
        c = self._choice(rows)
        if c.probing:
            c.probe.append(seconds)
            # (the first warmed the other count's threads up); a step far slower ends the probe at once
            if len(c.probe) > self.probe_steps or len(c.probe) > 1 and seconds > _HOPELESS * max(c.recent):
                self._settle(rows, c)
            return
        c.recent.append(seconds)
        c.countdown -= 1
        if c.countdown <= 0 and len(c.recent) == self.probe_steps:
            c.probing, c.probe = True, []

    def choices(self) -> dict[int, int]:
        """Each batch size's chosen count (for logs and tests)."""
        return {key: c.threads for key, c in self._choices.items()}

    def _choice(self, rows: int) -> _Choice:
        c = self._choices.get(rows)
        if c is None:
            c = self._choices[rows] = _Choice(self.most, deque(maxlen=self.probe_steps), self.first_period,
                                             self.first_period)
        return c

    def _other(self, threads: int) -> int:
        return 1 if threads == self.most else self.most

    def _settle(self, rows: int, c: _Choice) -> None:
        probed, chosen = statistics.median(c.probe[1:]), statistics.median(c.recent)
        if probed < (1 - self.margin) * chosen:
            c.threads, c.period = self._other(c.threads), self.first_period
            c.recent.clear()
            log.info("engine: steps of %d sequences on %d threads now (%.2f ms a step against %.2f)", rows, c.threads,
                     1000 * probed, 1000 * chosen)
        else:
            c.period = min(2 * c.period, self.most_period)
        c.probing, c.probe, c.countdown = False, [], c.period
