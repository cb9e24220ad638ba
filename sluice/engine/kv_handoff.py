"""The engine's side of disaggregated serving.

Context (`KvExport`): the request runs as any other until each choice has sampled its first token; then its
sequences are parked (out of the batch, blocks kept), and once every choice is parked their blocks go under
a lease and the ingress is answered with the handle. A lease ends when the generation engine releases it,
when it expires (--kv-lease-timeout), or when the request is aborted; then the blocks are freed (the prefix
cache keeps them as any finished request's).

Generation (`KvImport`): each choice starts as prompt + its first token. Its blocks are allocated here (the
prefix cache's hits first: only the rest is read), the transport copies the peer's blocks in, and the
choices join the running batch with their prompt computed; their first tokens go out with the next step.
A read that fails recomputes the prompt here, or fails the request (--kv-load-failure).
"""
from __future__ import annotations

import base64
import json
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import numpy as np
import torch
import zmq
from prometheus_client import Counter, Histogram

from sluice.base.config import ServerConfig
from sluice.base.disagg import bound_port, endpoint
from sluice.engine.kv_transfer import BlockCopy, Exporter, Importer, KvReadError, ShmExporter, ShmImporter, layout_of
from sluice.engine.model_runner import StepSamples
from sluice.engine.sampler import TokenLogprobs
from sluice.engine.scheduler import Scheduler, StepResult
from sluice.engine.sequence import Sequence, Status
from sluice.ipc.kv import ContextAnswer, ContextChoice, ContextMessage, ContextState, ContextUsage, KvHandle, KvRelease
from sluice.ipc.messages import (EngineRequest, FinishReason, Frame, Frames, IngressInput, KvExport, KvImport,
                                 bytes_to_ids, ids_to_bytes)
from sluice.ipc.transport import PushPool
from sluice.schemas.openai import DisaggregatedParams

log = logging.getLogger("sluice.engine")
_MAX_PEERS = 64  # release sockets kept open to context engines
_TAKEN_HANDLES = 4096  # transfer ids of the handles this engine took last (one sent again is refused)
_json = msgspec.json.Encoder()
_control = msgspec.msgpack.Decoder(KvRelease)

TRANSFER_SECONDS = Histogram("sluice:kv_transfer_seconds", "Reading a prompt's KV blocks from a context worker",
                             buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
TRANSFER_BYTES = Counter("sluice:kv_transfer_bytes", "KV bytes read from context workers")
IMPORTS = Counter("sluice:kv_imports", "generation_only requests by how their KV arrived",
                  ["outcome"])  # read, cached (nothing to read), recomputed, failed
LEASES = Counter("sluice:kv_leases", "Context leases by how they ended", ["end"])  # released, expired, aborted

Fail = Callable[[Sequence, str], None]


@dataclass
class _Export:
    msg: EngineRequest
    seqs: list[Sequence]
    first: dict[int, int] = field(default_factory=dict)  # choice -> its first token
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # choice -> its first token's, when asked


@dataclass
class _Lease:
    request_id: str
    seqs: list[Sequence]
    slot: int
    expires: float


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


def exporter_for(cfg: ServerConfig, dtype: torch.dtype, device: torch.device) -> Exporter | None:
    """A context worker's transport, which allocates its cache (before the model runner does)."""
    if cfg.role != "context":
        return None
    if cfg.kv_transfer == "mooncake":
        from sluice.engine.kv_mooncake import MooncakeExporter

        return MooncakeExporter(cfg, dtype, device)
    return ShmExporter(cfg.addresses.shm_dir, dtype, device)


def importer_for(cfg: ServerConfig, runner) -> Importer | None:
    if cfg.role != "generation":
        return None
    caches = getattr(runner, "kv_caches", [])
    if cfg.kv_transfer == "mooncake":
        from sluice.engine.kv_mooncake import MooncakeImporter

        return MooncakeImporter(cfg, caches, layout_of(runner))
    return ShmImporter(caches, layout_of(runner))


class KvHandOff:
    def __init__(self, cfg: ServerConfig, scheduler: Scheduler, runner, exporter: Exporter | None,
                 importer: Importer | None, fail: Fail) -> None:
        if cfg.role != "both" and runner.sliding_window is not None:
            raise SystemExit(f"--role {cfg.role}: handing over the KV of a model with sliding-window attention "
                             "is not supported yet (serve it with --role both, or with --runner replay)")
        self.cfg = cfg
        self.scheduler = scheduler
        self.exporter = exporter
        self.importer = importer
        self.layout = layout_of(runner)
        self._fail = fail
        self._ctx: zmq.Context = zmq.Context.instance()
        self._exports: dict[str, _Export] = {}
        self._leases: dict[str, _Lease] = {}  # transfer id -> lease
        self._imports: list[_Import] = []
        self._first_logprobs: list[TokenLogprobs | None] = []  # of the first tokens admit() emits, in order
        self._replies: PushPool[IngressInput] = PushPool(self._ctx)
        self._peers: OrderedDict[str, zmq.Socket] = OrderedDict()
        self._taken: OrderedDict[str, str] = OrderedDict()  # transfer id -> the request that took the handle
        self._timing = open(cfg.kv_timing_output, "a", buffering=1) if cfg.kv_timing_output else None
        self._control: zmq.Socket | None = None
        self.port = 0  # the control port, where this engine exports (a context worker's)
        if exporter is not None:
            self._control = self._ctx.socket(zmq.PULL)
            self._control.bind(endpoint(cfg, cfg.kv_transfer_port, bind=True))
            self.port = bound_port(self._control)
            self.agent = endpoint(cfg, self.port)

    # ---- requests in ------------------------------------------------------------------------------------------

    def start(self, msg: EngineRequest, seqs: list[Sequence]) -> None:
        if isinstance(msg.kv, KvExport):
            if self.exporter is None:
                return self._fail(seqs[0], "this server is not a context worker")
            for seq in seqs:
                seq.export = True
                self.scheduler.add(seq)
            self._exports[msg.request_id] = _Export(msg, seqs)
            return
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
        self._imports.append(_Import(msg, handle, live, ended, time.monotonic(), taken_by))

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
        """The request is aborted or failed: its parked choices and leases are freed, its import dropped."""
        export = self._exports.pop(request_id, None)
        if export is not None:
            for seq in export.seqs:
                if seq.export and seq.index in export.first:
                    self.scheduler.release(seq)
        for tid in [t for t, lease in self._leases.items() if lease.request_id == request_id]:
            self._end_lease(tid, "aborted")
        for job in [j for j in self._imports if j.msg.request_id == request_id]:
            self._imports.remove(job)
            if job.handle is not None and job.taken_by is None:
                self._release(job.handle)

    # ---- context side -----------------------------------------------------------------------------------------

    def park(self, result: StepResult, samples: StepSamples | None) -> None:
        """Choices that sampled their first token and left the batch with their blocks (their samples leave the
        step's, which stay aligned with its new tokens)."""
        logprobs = samples.logprobs if samples is not None and samples.logprobs else []
        firsts = [logprobs[row] if logprobs else None for row in result.exported_rows]
        if samples is not None:
            for row in sorted(result.exported_rows, reverse=True):
                del samples.tokens[row]
                if samples.logprobs:
                    del samples.logprobs[row]
        for (seq, token), lp in zip(result.exported, firsts):
            export = self._exports.get(seq.request_id)
            if export is None:  # (aborted in the same step)
                self.scheduler.release(seq)
                continue
            export.first[seq.index] = token
            if lp is not None:
                export.logprobs[seq.index] = lp
            if len(export.first) == len(export.seqs):
                del self._exports[seq.request_id]
                self._lease(export)

    def _lease(self, export: _Export) -> None:
        msg, seqs, kv = export.msg, sorted(export.seqs, key=lambda s: s.index), export.msg.kv
        assert self.exporter is not None and isinstance(kv, KvExport)
        tid, tag = secrets.token_hex(8), secrets.randbits(63) | 1
        slot = self.exporter.leases.take(tag)
        if slot is None:
            for seq in seqs:
                self.scheduler.release(seq)
            return self._fail(seqs[0], "the context worker holds too many KV leases; retry")
        expires = time.time() + self.cfg.kv_lease_timeout
        self._leases[tid] = _Lease(msg.request_id, seqs, slot, time.monotonic() + self.cfg.kv_lease_timeout)
        handle = KvHandle(tid, self.exporter.name, self.agent, self.layout, seqs[0].num_prompt_tokens,
                          [ids_to_bytes(s.block_table) for s in seqs], [ids_to_bytes(s.window_table) for s in seqs]
                          if any(s.window_table for s in seqs) else [], slot, tag, [s.seed for s in seqs],
                          self.exporter.location(), expires)
        prompt = seqs[0].token_ids[:seqs[0].num_prompt_tokens]
        prompt_i32 = np.asarray(prompt, dtype="<i4").tobytes()
        cached = seqs[0].num_cached_tokens or 0
        state = ContextState(handle, prompt_i32, kv.output_prefix_len, cached)
        # TensorRT-LLM's orchestrator asks that its disagg_request_id be the pair's id, and reads it back
        ctx_id = kv.disagg_request_id if kv.disagg_request_id is not None else secrets.randbits(63)
        params = DisaggregatedParams(
            request_type="context_only", first_gen_tokens=[export.first[s.index] for s in seqs],
            first_gen_log_probs=[_wire_logprobs(export.first[s.index], export.logprobs[s.index]) for s in seqs]
            if len(export.logprobs) == len(seqs) else None,
            ctx_request_id=ctx_id, encoded_opaque_state=state.encode(), disagg_request_id=ctx_id)
        choice = ContextChoice(params, text="") if kv.completion else ContextChoice(params, message=ContextMessage())
        answer = ContextAnswer(
            id=msg.request_id, object="text_completion" if kv.completion else "chat.completion",
            created=int(time.time()), model=kv.model, choices=[choice],
            usage=ContextUsage(len(prompt), len(seqs), len(prompt) + len(seqs), {"cached_tokens": cached}),
            prompt_token_ids=prompt,
            prompt_token_ids_b64=base64.b64encode(prompt_i32).decode() if kv.prompt_b64 else msgspec.UNSET)
        self._replies.get(kv.reply_to).put(Frames([Frame(msg.request_id, _json.encode(answer), done=True)]))

    def _end_lease(self, tid: str, how: str) -> None:
        lease = self._leases.pop(tid, None)
        if lease is None:
            return
        assert self.exporter is not None
        self.exporter.leases.clear(lease.slot)  # first: a reader that overlaps the free sees the lease gone
        for seq in lease.seqs:
            self.scheduler.release(seq)
        LEASES.labels(how).inc()

    def poll(self) -> None:
        """Releases from generation engines, and leases past their time."""
        if self._control is not None:
            while True:
                try:
                    raw = self._control.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = _control.decode(raw)
                except msgspec.MsgspecError:
                    continue
                self._end_lease(msg.transfer_id, "released")
        now = time.monotonic()
        for tid in [t for t, lease in self._leases.items() if lease.expires < now]:
            log.warning("a KV lease expired unread (request %s)", self._leases[tid].request_id)
            self._end_lease(tid, "expired")

    # ---- generation side --------------------------------------------------------------------------------------

    def admit(self) -> StepResult:
        """Starts the imports that fit now: the first tokens (and the choices they end) to emit this step."""
        self.poll()
        out = StepResult()
        self._first_logprobs = []
        for job in list(self._imports):
            if self._admit(job, out):
                self._imports.remove(job)
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
            return self._emit(job, out)
        if time.monotonic() - job.since > self.cfg.kv_lease_timeout:
            return self._failed(job, out, "no room in the KV cache before the context worker's lease ended")
        if len(self.scheduler.running) + len(job.live) > self.scheduler.max_num_seqs:
            return False
        t0 = time.time()
        copies = self._allocate(handle, job.live)
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
            self.scheduler.bm.register_full_blocks(seq)  # now that they hold the data
            seq.num_cached_tokens = job.msg.kv.num_cached_tokens
            seq.first_scheduled_time = seq.first_token_time = seq.last_token_time = t1
            self.scheduler.add_running(seq)
        TRANSFER_SECONDS.observe(t1 - t0)
        TRANSFER_BYTES.inc(moved)
        IMPORTS.labels("read" if copies else "cached").inc()
        self._log_transfer(job, t0, t1, moved, sum(len(c.src) for c in copies), "read")
        return self._emit(job, out)

    def _fits(self, handle: KvHandle, live: list[Sequence]) -> bool:
        need = -(-handle.num_prompt_tokens // self.scheduler.bm.block_size)
        return all(s.num_prompt_tokens == handle.num_prompt_tokens and s.index < len(handle.blocks)
                   and len(handle.blocks[s.index]) == 4 * need for s in live) and not handle.window_blocks

    def _allocate(self, handle: KvHandle, live: list[Sequence]) -> list[BlockCopy] | None:
        """Blocks for each live choice's prompt, or None (nothing kept) when the cache has no room now; and the
        copies that fill them. The first choice takes its prefix-cache hits; the others share its full blocks
        (as the choices of one request do) and read their own last one."""
        bm, p = self.scheduler.bm, handle.num_prompt_tokens
        full = p // bm.block_size
        copies: list[BlockCopy] = []
        done: list[Sequence] = []
        for seq in live:
            hits = bm.cached_prefix(seq) if not done else done[0].block_table[:full]
            room = bm.can_allocate(seq, p - len(hits) * bm.block_size, hits)
            if not room:
                for s in done:
                    self.scheduler.release(s)
                return None
            bm.allocate(seq, p - len(hits) * bm.block_size, hits)
            seq.num_computed_tokens = p
            done.append(seq)
            src = bytes_to_ids(handle.blocks[seq.index]).tolist()
            if len(hits) < len(seq.block_table):
                copies.append(BlockCopy("block_table", src[len(hits):], seq.block_table[len(hits):]))
        return copies

    def _emit(self, job: _Import, out: StepResult) -> bool:
        """The job's first tokens go out (with their logprobs, where the context worker sent them); the choices
        that end on them end."""
        now = time.time()
        assert isinstance(job.msg.kv, KvImport)
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
        self._log_transfer(job, time.time(), time.time(), 0, 0, f"failed: {why}")
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

    def _log_transfer(self, job: _Import, start: float, end: float, moved: int, blocks: int, outcome: str) -> None:
        if self._timing is not None:
            self._timing.write(json.dumps({"request_id": job.msg.request_id, "kv_transfer": {
                "backend": job.handle.backend if job.handle else None, "start": start, "end": end, "bytes": moved,
                "blocks": blocks, "outcome": outcome}}) + "\n")

    # ---- the step -----------------------------------------------------------------------------------------------

    def merged(self, first: StepResult, result: StepResult, samples: StepSamples | None
               ) -> tuple[StepResult, StepSamples | None]:
        """The step's outputs with imported requests' first tokens (and their logprobs) before its own."""
        if not first.new_tokens and not first.finished:
            return result, samples
        tokens = [t for _, t in first.new_tokens]
        if samples is None:
            samples = StepSamples([])
        if samples.logprobs or any(lp is not None for lp in self._first_logprobs):
            own: list[TokenLogprobs | None] = list(samples.logprobs) or [None] * len(samples.tokens)
            samples.logprobs = list(self._first_logprobs) + own
        samples.tokens = tokens + samples.tokens
        result.new_tokens = first.new_tokens + result.new_tokens
        result.finished = first.finished + result.finished
        return result, samples


def _wire_logprobs(token: int, lp: TokenLogprobs) -> list[dict]:
    """A first token's logprobs as TensorRT-LLM's first_gen_log_probs holds one position's: {token_id, logprob,
    rank} of the sampled token, then of each of the most likely ones."""
    return [{"token_id": token, "logprob": lp.logprob, "rank": lp.rank}] + [
        {"token_id": t, "logprob": p, "rank": i + 1} for i, (t, p) in enumerate(zip(lp.top_ids, lp.top_logprobs))]


def _token_logprobs(entries: list[tuple[int, float, int]]) -> TokenLogprobs:
    (_, logprob, rank), top = entries[0], entries[1:]
    return TokenLogprobs(logprob, rank, [t for t, _, _ in top], [p for _, p, _ in top])
