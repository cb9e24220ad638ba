"""What the engine tells the postproc shards after each step: one StepOutputs message per shard (new
tokens, verdicts, logprobs, requests ended outside the step), sent on a thread of their own (Outbox)."""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from sluice.base import metrics
from sluice.base.config import ServerConfig
from sluice.engine.model_runner import StepSamples
from sluice.engine.sampler import TokenLogprobs
from sluice.engine.scheduler import StepResult
from sluice.engine.sequence import Sequence
from sluice.ipc.messages import (Failed, Finished, Logprobs, PostprocInput, Predicted, PromptLogprobs, Started,
                                 StepOutputs, StepsTaken, Timings, ids_to_bytes)
from sluice.ipc.transport import PushChannel

log = logging.getLogger("sluice.engine")
_STALE_S = 1.0  # a postproc shard that takes no steps for this long is not waited for (it died)


@dataclass
class _ShardStep:
    started: list = field(default_factory=list)
    request_ids: list = field(default_factory=list)
    indices: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    finished: list = field(default_factory=list)
    aborted: dict = field(default_factory=dict)  # request ids, once each
    failed: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    timings: list = field(default_factory=list)
    predicted: list = field(default_factory=list)


def pack_logprobs(entries: list[TokenLogprobs]) -> Logprobs:
    k = len(entries[0].top_ids)
    return Logprobs(
        logprobs=np.array([e.logprob for e in entries], dtype=np.float32).tobytes(),
        ranks=ids_to_bytes([e.rank for e in entries]),
        top_ids=ids_to_bytes([i for e in entries for i in e.top_ids]),
        top_logprobs=np.array([v for e in entries for v in e.top_logprobs], dtype=np.float32).tobytes(),
        k=k,
    )


@dataclass
class Ended:
    """Requests the engine ended outside a step's own verdicts, for their postproc shards to hear of."""

    aborted: list[Sequence] = field(default_factory=list)  # every choice of requests ended by an Abort
    failed: list[tuple[Sequence, Failed]] = field(default_factory=list)  # (one choice of the request, why)

    def __bool__(self) -> bool:
        return bool(self.aborted or self.failed)


def step_outputs(result: StepResult, samples: StepSamples | None, ended: Ended) -> dict[int, StepOutputs]:
    """One step's message for each postproc shard that has something in it."""
    shards: dict[int, _ShardStep] = {}

    def shard_of(seq: Sequence) -> _ShardStep:
        out = shards.get(seq.shard)
        if out is None:
            out = shards[seq.shard] = _ShardStep()
        head = seq.leader or seq
        if not head.started:
            head.started = True
            out.started.append(Started(seq.request_id, seq.postproc_spec, seq.num_prompt_tokens,
                                       seq.num_cached_tokens or 0))
        return out

    if samples is not None:
        for chunk in samples.prompt_logprobs:
            shard_of(chunk.seq).prompt_logprobs.append(
                PromptLogprobs(chunk.seq.request_id, chunk.start,
                               ids_to_bytes(chunk.seq.token_ids[chunk.start : chunk.start + len(chunk.entries)]),
                               pack_logprobs(chunk.entries)))
        entries = samples.logprobs or [None] * len(samples.tokens)
        for (seq, token), lp in zip(result.new_tokens, entries):
            out = shards.get(seq.shard)
            if out is None or not (seq.leader or seq).started:
                out = shard_of(seq)
            if lp is not None:
                out.logprobs.append((len(out.request_ids), pack_logprobs([lp])))
            out.request_ids.append(seq.request_id)
            out.indices.append(seq.index)
            out.tokens.append(token)
    for seq, accepted, rejected in result.predictions:
        shard_of(seq).predicted.append(Predicted(seq.request_id, seq.index, accepted, rejected))
    for seq, reason in result.finished:
        out = shard_of(seq)
        out.finished.append(Finished(seq.request_id, seq.index, reason))
        out.timings.append(Timings(seq.request_id, seq.index, seq.arrival_time, seq.render_done_time,
                                   seq.first_scheduled_time, seq.first_token_time, seq.last_token_time))
        metrics.observe_finished(seq)
    for seq in ended.aborted:
        if (seq.leader or seq).started:  # else its shard never heard of it
            shard_of(seq).aborted[seq.request_id] = None
    for seq, failed in ended.failed:
        shard_of(seq).failed.append(failed)
    return {shard: StepOutputs(out.started, out.request_ids, ids_to_bytes(out.indices), ids_to_bytes(out.tokens),
                               out.finished, list(out.aborted), out.failed, out.logprobs, out.prompt_logprobs,
                               out.timings, out.predicted)
            for shard, out in shards.items()}


class Outbox:
    """Encodes and sends step outputs on a thread, off the model's critical path; counts the steps each
    postproc shard has not taken yet (it says so: StepsTaken)."""

    def __init__(self, ctx: zmq.Context, cfg: ServerConfig) -> None:
        self._shards = [PushChannel[PostprocInput](ctx, cfg.addresses.postproc(k), **cfg.bulk())
                        for k in range(cfg.postproc_workers)]
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._ahead = cfg.max_steps_ahead
        self._untaken = [0] * cfg.postproc_workers
        self._full_since = 0.0
        threading.Thread(target=self._run, name="engine-outbox", daemon=True).start()

    def emit(self, result: StepResult, samples: StepSamples | None, ended: Ended) -> None:
        for shard, msg in step_outputs(result, samples, ended).items():
            self._untaken[shard] += 1
            self._queue.put((shard, msg))

    def taken(self, msg: StepsTaken) -> None:
        self._untaken[msg.shard] = max(0, self._untaken[msg.shard] - msg.count)
        self._full_since = 0.0

    def full(self) -> bool:
        """Whether a shard has --max-steps-ahead steps it has not taken: the engine waits before its next step.
        A shard that falls behind then neither piles up steps nor coalesces more than that many tokens an
        event. A shard silent for _STALE_S (one that died with steps in its socket) counts as caught up."""
        if not self._ahead or max(self._untaken) < self._ahead:
            return False
        now = time.monotonic()
        if not self._full_since:
            self._full_since = now
        elif now - self._full_since > _STALE_S:
            log.warning("engine: a postproc shard took no steps for %.1f s: sending on", _STALE_S)
            self._untaken = [0] * len(self._untaken)
            self._full_since = 0.0
            return False
        return True

    def _run(self) -> None:
        while True:
            shard, msg = self._queue.get()
            self._shards[shard].put(msg)
