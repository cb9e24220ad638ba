"""A generation engine's side of disaggregated serving (engine/kv_handoff.py holds the context side).

Each choice starts as prompt + its first token. Its blocks are allocated here (the prefix cache's hits first:
only the rest is read), the transport copies the peer's blocks in, and the choices join the running batch with
their prompt computed; their first tokens go out with the next step. Sliding-window layers (a window pool of
their own, or every layer's window in the one pool) take only the blocks the next token attends to: those
the context worker still held. A read that fails recomputes the prompt here, or fails the request
(--kv-load-failure).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, TextIO

import msgspec
import numpy as np
import zmq
from prometheus_client import Counter, Histogram

from sluice.base.config import ServerConfig
from sluice.engine.block_manager import BlockManager
from sluice.engine.kv_transfer import BlockCopy, Importer, KvReadError, log_transfer
from sluice.engine.model_runner import PromptLogprobChunk, StepSamples
from sluice.engine.sampler import TokenLogprobs
from sluice.engine.scheduler import Scheduler, StepResult
from sluice.engine.sequence import Sequence, Status
from sluice.ipc.kv import KvHandle, KvRelease
from sluice.ipc.messages import EngineRequest, FinishReason, KvImport, Logprobs, bytes_to_ids

log = logging.getLogger("sluice.engine")
_MAX_PEERS = 64  # release sockets kept open to context engines
_TAKEN_HANDLES = 4096  # transfer ids of the handles this engine took last (one sent again is refused)

TRANSFER_SECONDS = Histogram("sluice:kv_transfer_seconds", "Reading a prompt's KV blocks from a context worker",
                             buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
TRANSFER_BYTES = Counter("sluice:kv_transfer_bytes", "KV bytes read from context workers")
IMPORTS = Counter("sluice:kv_imports", "generation_only requests by how their KV arrived",
                  ["outcome"])  # read, cached (nothing to read), recomputed, failed

Fail = Callable[[Sequence, str], None]


@dataclass
class _Import:
    msg: EngineRequest
    handle: KvHandle | None  # None: it could not be decoded
    live: list[Sequence]  # the choices that go on from their first token
    ended: list[tuple[Sequence, FinishReason]]  # the choices their first token ends
    since: float
    taken_by: str | None = None  # the request that took its handle first, when not this one: not ours to read

    @property
    def seqs(self) -> list[Sequence]:
        return sorted(self.live + [s for s, _ in self.ended], key=lambda s: s.index)


class KvImports:
    def __init__(self, cfg: ServerConfig, scheduler: Scheduler, importer: Importer | None, fail: Fail,
                 ctx: zmq.Context, timing: TextIO | None) -> None:
        self.cfg = cfg
        self.scheduler = scheduler
        self.importer = importer
        self._fail = fail
        self._ctx = ctx
        self._timing = timing
        self.pending: list[_Import] = []
        self._first_logprobs: list[TokenLogprobs | None] = []  # of the first tokens admit() emits, in order
        self._prompt_logprobs: list[PromptLogprobChunk] = []  # the context workers', of the prompts admit() read
        self._peers: OrderedDict[str, zmq.Socket] = OrderedDict()
        self._taken: OrderedDict[str, str] = OrderedDict()  # transfer id -> the request that took the handle

    def start(self, msg: EngineRequest, seqs: list[Sequence]) -> None:
        assert isinstance(msg.kv, KvImport)
        try:
            handle: KvHandle | None = KvHandle.decode(msg.kv.handle)
        except (msgspec.MsgspecError, ValueError):
            handle = None
        live, ended = [], []
        for seq, first in zip(seqs, bytes_to_ids(msg.kv.first_tokens).tolist()):
            if handle is not None and msg.sampling.seed is None and seq.index < len(handle.seeds):
                seq.seed = handle.seeds[seq.index]
            reason = self._first_verdict(seq, first)
            if reason is None:
                live.append(seq)
            else:
                seq.status = Status.FINISHED  # (a choice after it must not wait for its prompt)
                ended.append((seq, reason))
        taken_by = self._take(handle, msg.request_id) if handle is not None else None
        self.pending.append(_Import(msg, handle, live, ended, time.monotonic(), taken_by))

    def _take(self, handle: KvHandle, request_id: str) -> str | None:
        """Who took `handle` before `request_id`, if anyone. A handle is one lease: read twice, its blocks
        would be read after (or while) the first reader released them to be freed and reused."""
        first = self._taken.setdefault(handle.transfer_id, request_id)
        self._taken.move_to_end(handle.transfer_id)
        if len(self._taken) > _TAKEN_HANDLES:
            self._taken.popitem(last=False)
        return first if first != request_id else None

    def _first_verdict(self, seq: Sequence, first: int) -> FinishReason | None:
        """Takes the choice's first token as sampling would have: its grammar sees it, and it may end it."""
        if seq.grammar is not None:
            seq.grammar.observe(seq.token_ids, first)
        seq.token_ids.append(first)
        return self.scheduler.finish_reason(seq, first)

    def forget(self, request_id: str) -> None:
        for job in [j for j in self.pending if j.msg.request_id == request_id]:
            self.pending.remove(job)
            if job.handle is not None and job.taken_by is None:
                self._release(job.handle)

    def admit(self) -> StepResult:
        """Starts the imports that fit now: the first tokens (and the choices they end) to emit this step."""
        out = StepResult()
        self._first_logprobs, self._prompt_logprobs = [], []
        for job in list(self.pending):
            if self._admit(job, out):
                self.pending.remove(job)
        return out

    def _admit(self, job: _Import, out: StepResult) -> bool:
        """Whether the job is done with (started, recomputing or failed); False: it waits for room."""
        handle = job.handle
        if job.taken_by is not None:
            return self._failed(job, out, f"its KV handle was used before, by request {job.taken_by}")
        if handle is None or not self._fits(handle, job.live):
            return self._failed(job, out, "the KV handle does not fit this request")
        if not job.live:  # every choice ended on its first token: nothing to read
            self._release(handle)
            IMPORTS.labels("cached").inc()
            return self._emit(job, out, read=True)
        if time.monotonic() - job.since > self.cfg.kv_lease_timeout:
            return self._failed(job, out, "no room in the KV cache before the context worker's lease ended")
        if len(self.scheduler.running) + len(job.live) > self.scheduler.max_num_seqs:
            return False
        t0 = time.time()
        try:
            copies = self._allocate(handle, job.live)
        except KvReadError as e:
            return self._failed(job, out, str(e))
        if copies is None:
            return False
        try:
            moved = self.importer.read(handle, copies) if self.importer is not None and copies else 0
        except KvReadError as e:
            for seq in job.live:
                self.scheduler.release(seq)
            return self._failed(job, out, str(e))
        t1 = time.time()
        self._release(handle)
        assert isinstance(job.msg.kv, KvImport)
        for seq in job.live:
            for pool in self._pools():  # now that they hold the data
                pool.register_full_blocks(seq)
            seq.num_cached_tokens = job.msg.kv.num_cached_tokens
            seq.first_scheduled_time = seq.first_token_time = seq.last_token_time = t1
            self.scheduler.add_running(seq)
        TRANSFER_SECONDS.observe(t1 - t0)
        TRANSFER_BYTES.inc(moved)
        IMPORTS.labels("read" if copies else "cached").inc()
        self._log(job, t0, t1, moved, sum(len(c.src) for c in copies), "read")
        return self._emit(job, out, read=True)

    def _pools(self) -> list[BlockManager]:
        return [self.scheduler.bm] + ([self.scheduler.window_pool] if self.scheduler.window_pool else [])

    def _fits(self, handle: KvHandle, live: list[Sequence]) -> bool:
        size = 4 * -(-handle.num_prompt_tokens // self.scheduler.bm.block_size)  # (int32 ids)
        windowed = self.scheduler.window_pool is not None
        return all(s.num_prompt_tokens == handle.num_prompt_tokens and s.index < len(handle.blocks)
                   and len(handle.blocks[s.index]) == size
                   and (not windowed or s.index < len(handle.window_blocks)
                        and len(handle.window_blocks[s.index]) == size) for s in live) \
            and windowed == bool(handle.window_blocks)

    def _allocate(self, handle: KvHandle, live: list[Sequence]) -> list[BlockCopy] | None:
        """Blocks for each live choice's prompt, or None (nothing kept) when the cache has no room now; and the
        copies that fill them (KvReadError: the peer no longer holds a block the next token attends to). The
        first choice takes its prefix-cache hits; the others share its full blocks (as the choices of one
        request do) and read their own last one."""
        sched = self.scheduler
        bm, window_pool, p = sched.bm, sched.window_pool, handle.num_prompt_tokens
        # the first position and block the next token's window reaches (the one pool's when every layer has it)
        reach = max(0, p - sched.sliding_window + 1) if sched.sliding_window else 0
        first = reach // bm.block_size
        full = p // bm.block_size
        windowed_one_pool = bool(sched.sliding_window) and window_pool is None
        copies: list[BlockCopy] = []
        done: list[Sequence] = []
        for seq in live:
            # (a window in the one pool: the first choice's blocks before it are freed, not shared)
            hits = bm.cached_prefix(seq) if not done else [] if windowed_one_pool else done[0].block_table[:full]
            if window_pool is not None:  # (allocated first, while the computed count is 0: blocks first.. only)
                seq.window_table.extend([-1] * first)
            if not (bm.can_allocate(seq, p - len(hits) * bm.block_size, hits)
                    and (window_pool is None or window_pool.can_allocate(seq, p))):
                seq.window_table.clear()
                for s in done:
                    sched.release(s)
                return None
            if window_pool is not None:
                window_pool.allocate(seq, p)
            bm.allocate(seq, p - len(hits) * bm.block_size, hits)
            if windowed_one_pool:  # (the context worker freed what the window left)
                bm.free_outside_window(seq, reach)
            seq.num_computed_tokens = p
            done.append(seq)
            try:
                copies += _copies("block_table", handle.blocks[seq.index], seq.block_table, len(hits))
                if window_pool is not None:
                    copies += _copies("window_table", handle.window_blocks[seq.index], seq.window_table, 0)
            except KvReadError:
                for s in done:
                    sched.release(s)
                raise
        return copies

    def _emit(self, job: _Import, out: StepResult, read: bool = False) -> bool:
        """The job's first tokens go out (with their logprobs, where the context worker sent them), and where
        its prompt was `read` (not computed here), the context worker's prompt logprobs; the choices that end on
        their first token end."""
        now = time.time()
        assert isinstance(job.msg.kv, KvImport)
        scored = job.msg.kv.prompt_logprobs
        if read and scored is not None and (first := job.seqs[0]).scores_prompt:
            self._prompt_logprobs.append(PromptLogprobChunk(first, 1, _unpacked(scored)))
        first_logprobs = job.msg.kv.first_logprobs
        for seq in job.seqs:
            out.new_tokens.append((seq, seq.token_ids[-1]))
            self._first_logprobs.append(_token_logprobs(first_logprobs[seq.index])
                                        if seq.index < len(first_logprobs) else None)
        for seq, reason in job.ended:
            seq.first_scheduled_time = seq.first_token_time = seq.last_token_time = now
            seq.num_cached_tokens = job.msg.kv.num_cached_tokens
            out.finished.append((seq, reason))
        return True

    def _failed(self, job: _Import, out: StepResult, why: str) -> bool:
        log.warning("KV import for %s failed (%s): %s", job.msg.request_id, self.cfg.kv_load_failure, why)
        if job.handle is not None and job.taken_by is None:  # (another request's lease is not this one's to end)
            self._release(job.handle)
        self._log(job, time.time(), time.time(), 0, 0, f"failed: {why}")
        if self.cfg.kv_load_failure == "fail":
            IMPORTS.labels("failed").inc()
            self._fail(job.seqs[0], f"the prompt's KV cache could not be loaded from the context worker: {why}")
            return True
        IMPORTS.labels("recomputed").inc()
        for seq in job.live:  # prompt + first token: prefilled here, the next token sampled after the first
            self.scheduler.add(seq)
        return self._emit(job, out)

    def _release(self, handle: KvHandle) -> None:
        """Tells the context engine it may free the blocks (best effort: an expired lease frees them too)."""
        sock = self._peers.get(handle.agent)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.connect(handle.agent)
            if len(self._peers) >= _MAX_PEERS:
                self._peers.popitem(last=False)[1].close()
            self._peers[handle.agent] = sock
        try:
            sock.send(msgspec.msgpack.encode(KvRelease(handle.transfer_id)), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _log(self, job: _Import, start: float, end: float, moved: int, blocks: int, outcome: str) -> None:
        log_transfer(self._timing, job.msg.request_id, "recv", job.handle.backend if job.handle else None, start, end,
                     moved, blocks, outcome)

    def merged(self, first: StepResult, result: StepResult, samples: StepSamples | None
               ) -> tuple[StepResult, StepSamples | None]:
        """The step's outputs with imported requests' first tokens (and their logprobs) before its own."""
        if not first.new_tokens and not first.finished:
            return result, samples
        tokens = [t for _, t in first.new_tokens]
        if samples is None:
            samples = StepSamples([])
        samples.prompt_logprobs = self._prompt_logprobs + samples.prompt_logprobs
        if samples.logprobs or any(lp is not None for lp in self._first_logprobs):
            own: list[TokenLogprobs | None] = list(samples.logprobs) or [None] * len(samples.tokens)
            samples.logprobs = list(self._first_logprobs) + own
        samples.tokens = tokens + samples.tokens
        result.new_tokens = first.new_tokens + result.new_tokens
        result.finished = first.finished + result.finished
        return result, samples


def _copies(pool: str, peer_table: bytes, table: list[int], start: int) -> list[BlockCopy]:
    """The copies that fill `table`'s blocks from `start` on (those it holds: a window's freed ones are -1) from
    the peer's table of the same blocks."""
    src = bytes_to_ids(peer_table).tolist()
    pairs = [(s, d) for s, d in zip(src[start:], table[start:]) if d >= 0]
    if any(s < 0 for s, _ in pairs):
        raise KvReadError("the context worker no longer holds a block the next token attends to")
    return [BlockCopy(pool, [s for s, _ in pairs], [d for _, d in pairs])] if pairs else []


def _unpacked(lp: Logprobs) -> list[TokenLogprobs]:
    """engine/outputs.py's pack_logprobs undone."""
    chosen, ranks = np.frombuffer(lp.logprobs, dtype=np.float32), bytes_to_ids(lp.ranks)
    top_ids = bytes_to_ids(lp.top_ids).reshape(len(chosen), lp.k)
    top = np.frombuffer(lp.top_logprobs, dtype=np.float32).reshape(len(chosen), lp.k)
    return [TokenLogprobs(float(c), int(r), i.tolist(), v.tolist()) for c, r, i, v in zip(chosen, ranks, top_ids, top)]


def _token_logprobs(entries: list[tuple[int, float, int]]) -> TokenLogprobs:
    (_, logprob, rank), top = entries[0], entries[1:]
    return TokenLogprobs(logprob, rank, [t for t, _, _ in top], [p for _, p, _ in top])
