"""Continuous batching under a per-step token budget.

Each step serves running sequences first (decodes and the next chunks of
partially computed prompts), then admits waiting ones while the budget, the
sequence limit and the KV cache allow. When the cache cannot hold a running
sequence's next tokens, the newest running sequence is preempted: its blocks
are freed and it is recomputed later from its tokens so far.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence, this step

    def samples(self, i: int) -> bool:
        """Whether sequence i's next token is sampled this step (its tokens are all computed)."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens


@dataclass
class StepResult:
    new_tokens: list[tuple[Sequence, int]] = field(default_factory=list)
    finished: list[tuple[Sequence, str]] = field(default_factory=list)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._by_id: dict[str, Sequence] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, seq: Sequence) -> None:
        assert seq.request_id not in self._by_id, f"duplicate request id {seq.request_id}"
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._by_id.get(request_id)
        if seq is not None:
            self._finish(seq)
        return seq

    def schedule(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        seqs, counts = [], []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            n = min(seq.num_uncomputed, budget)
            if not self._make_room(seq, n):
                continue  # seq itself was preempted
            self.bm.allocate(seq, n)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed, budget)
            if not self.bm.can_allocate(seq, n):
                break
            self.waiting.popleft()
            self.bm.allocate(seq, n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts) if seqs else None

    def _make_room(self, seq: Sequence, n: int) -> bool:
        while not self.bm.can_allocate(seq, n):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.deallocate(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, batch: ScheduledBatch, sampled: list[int]) -> StepResult:
        """Applies one step: `sampled` holds a token for each sequence that samples, in order."""
        result = StepResult()
        it = iter(sampled)
        for i, seq in enumerate(batch.seqs):
            samples = batch.samples(i)
            seq.num_computed_tokens += batch.num_new_tokens[i]
            if not samples:
                continue
            token = next(it)
            seq.token_ids.append(token)
            result.new_tokens.append((seq, token))
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._finish(seq)
                result.finished.append((seq, reason))
        return result

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        sp = seq.sampling
        if token in sp.stop_token_ids and seq.num_output_tokens >= sp.min_tokens:
            return "stop"
        if seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.bm.deallocate(seq)
        seq.status = Status.FINISHED
        del self._by_id[seq.request_id]
