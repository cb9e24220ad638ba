"""The replay runner: emits recorded token ids instead of running the model.

Everything else runs as in production (rendering, scheduling, KV accounting,
postproc parsing, SSE). Each new request takes the next recorded sequence, in
arrival order, cycling through the file; a request whose recording ran out
gets its first stop token. Without a file, tokens are random ids from the
vocabulary (seeded per request, so a seeded request replays the same).
"""
from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import numpy as np

from sluice.engine.model_runner import StepSamples
from sluice.engine.sampler import uniform_from
from sluice.engine.scheduler import ScheduledBatch


def load_recordings(path: str) -> list[list[int]]:
    """A JSONL file: one recorded output per line, as a list of ids or {"token_ids": [...]}."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            out.append(item["token_ids"] if isinstance(item, dict) else item)
    if not out:
        raise ValueError(f"{path}: no recorded sequences")
    return out


class ReplayRunner:
    sliding_window = None

    def __init__(self, vocab_size: int, recordings: list[list[int]] | None = None, step_cost_s: float = 0.0) -> None:
        self.vocab_size = vocab_size
        self.recordings = recordings
        self.step_cost_s = step_cost_s
        self._next = itertools.cycle(range(len(recordings or [0])))  # (each choice's recording, in turn)
        self._assigned: dict[tuple[str, int], int] = {}

    def run(self, batch: ScheduledBatch) -> StepSamples:
        if self.step_cost_s:
            time.sleep(self.step_cost_s)
        seqs = [seq for seq, samples in zip(batch.seqs, batch.sampled) if samples]
        if self.recordings is None:
            steps = np.array([len(s.token_ids) - s.num_prompt_tokens for s in seqs], np.uint64)
            u = uniform_from(np.array([s.seed for s in seqs], np.uint64), steps)
            return StepSamples([int(x) for x in u * self.vocab_size])
        tokens = []
        recordings, assigned = self.recordings, self._assigned
        for seq in seqs:
            step = len(seq.token_ids) - seq.num_prompt_tokens
            key = (seq.request_id, seq.index)
            if (i := assigned.get(key)) is None:
                i = assigned[key] = next(self._next)
            recorded = recordings[i]
            if step < len(recorded):
                tokens.append(recorded[step])
            else:
                tokens.append(seq.sampling.stop_token_ids[0] if seq.sampling.stop_token_ids else 0)
            if step + 1 >= len(recorded) or step + 1 >= seq.sampling.max_tokens:
                del assigned[key]
        return StepSamples(tokens)
