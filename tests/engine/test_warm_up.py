"""The engine's start-up warm-up (ModelRunner.warm_up)."""
from __future__ import annotations

import torch

from tests.engine.helpers import generate, make_engine, seq


def test_warm_up_leaves_the_engine_as_it_was(tiny_chat_dir):
    """The start-up warm-up runs on scratch cache slots: what a server generates after it is what it
    generates without it."""
    prompts = [[5, 17, 300, 42], list(range(40, 70)), list(range(40, 70)) + [3]]  # the last reuses a prefix
    outputs = []
    for warm in (False, True):
        runner, sched = make_engine(tiny_chat_dir, dtype=torch.bfloat16)
        if warm:
            assert runner.warm_up(2048, 64, 4096) > 0
        outputs.append(generate(runner, sched, [seq(f"w{i}", p, max_tokens=8, temperature=0)
                                                for i, p in enumerate(prompts)]))
    assert outputs[0] == outputs[1]
