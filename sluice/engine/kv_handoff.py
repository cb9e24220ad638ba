"""The engine's side of disaggregated serving.

Context (`KvExport`): the request runs as any other until each choice has sampled its first token; then its
sequences are parked (out of the batch, blocks kept), and once every choice is parked their blocks go under
a lease and the ingress is answered with the handle. A lease ends when the generation engine releases it,
when it expires (--kv-lease-timeout), or when the request is aborted; then the blocks are freed (the prefix
cache keeps them as any finished request's).

Generation (`KvImport`): engine/kv_import.py reads the blocks in.
"""
from __future__ import annotations

import base64
import logging
import secrets
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch
import zmq
from prometheus_client import Counter

from sluice.base.config import ServerConfig
from sluice.base.disagg import bound_port, endpoint, seal_state
from sluice.engine.kv_import import IMPORTS as IMPORTS
from sluice.engine.kv_import import Fail, KvImports
from sluice.engine.kv_transfer import (Exporter, Importer, ShmExporter, ShmImporter, cache_tensors, layout_of,
                                       log_transfer)
from sluice.engine.model_runner import StepSamples
from sluice.engine.outputs import pack_logprobs
from sluice.engine.sampler import TokenLogprobs
from sluice.engine.scheduler import Scheduler, StepResult
from sluice.engine.sequence import Sequence
from sluice.ipc.kv import (ContextAnswer, ContextChoice, ContextMessage, ContextState, ContextUsage, KvHandle, KvLayout,
                           KvRelease)
from sluice.ipc.messages import EngineRequest, Frame, Frames, IngressInput, KvExport, KvImport, ids_to_bytes
from sluice.ipc.transport import PushPool
from sluice.schemas.openai import DisaggregatedParams

log = logging.getLogger("sluice.engine")
_json = msgspec.json.Encoder()
_control = msgspec.msgpack.Decoder(KvRelease)

LEASES = Counter("sluice:kv_leases", "Context leases by how they ended", ["end"])  # released, expired, aborted


@dataclass
class _Export:
    msg: EngineRequest
    seqs: list[Sequence]
    first: dict[int, int] = field(default_factory=dict)  # choice -> its first token
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # choice -> its first token's, when asked
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # of prompt positions 1.., when asked


@dataclass
class _Lease:
    request_id: str
    seqs: list[Sequence]
    slot: int
    expires: float
    since: float  # wall-clock seconds when the blocks went under it (the transfer's start, on this side)
    backend: str


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
        self.cfg = cfg
        self.scheduler = scheduler
        self.exporter = exporter
        self.layout = layout_of(runner)
        self._block_bytes = _block_bytes(self.layout, getattr(runner, "kv_caches", []))
        self._fail = fail
        self._ctx: zmq.Context = zmq.Context.instance()
        self._exports: dict[str, _Export] = {}
        self._leases: dict[str, _Lease] = {}  # transfer id -> lease
        self._replies: PushPool[IngressInput] = PushPool(self._ctx)
        self._timing = open(cfg.kv_timing_output, "a", buffering=1) if cfg.kv_timing_output else None
        self.imports = KvImports(cfg, scheduler, importer, fail, self._ctx, self._timing)
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
        self.imports.start(msg, seqs)

    def forget(self, request_id: str) -> None:
        """The request is aborted or failed: its parked choices and leases are freed, its import dropped."""
        export = self._exports.pop(request_id, None)
        if export is not None:
            for seq in export.seqs:
                if seq.export and seq.index in export.first:
                    self.scheduler.release(seq)
        for tid in [t for t, lease in self._leases.items() if lease.request_id == request_id]:
            self._end_lease(tid, "aborted")
        self.imports.forget(request_id)

    # ---- context side -----------------------------------------------------------------------------------------

    def park(self, result: StepResult, samples: StepSamples | None) -> None:
        """Choices that sampled their first token and left the batch with their blocks (their samples leave the
        step's, which stay aligned with its new tokens)."""
        if samples is not None and samples.prompt_logprobs:  # (the answer holds them: no postproc hears of it)
            for chunk in [c for c in samples.prompt_logprobs if c.seq.export]:
                samples.prompt_logprobs.remove(chunk)
                if (export := self._exports.get(chunk.seq.request_id)) is not None:
                    export.prompt_logprobs += chunk.entries
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
        self._leases[tid] = _Lease(msg.request_id, seqs, slot, time.monotonic() + self.cfg.kv_lease_timeout,
                                   time.time(), self.exporter.name)
        handle = KvHandle(tid, self.exporter.name, self.agent, self.layout, seqs[0].num_prompt_tokens,
                          [ids_to_bytes(s.block_table) for s in seqs], [ids_to_bytes(s.window_table) for s in seqs]
                          if any(s.window_table for s in seqs) else [], slot, tag, [s.seed for s in seqs],
                          self.exporter.location(), expires)
        prompt = seqs[0].token_ids[:seqs[0].num_prompt_tokens]
        prompt_i32 = np.asarray(prompt, dtype="<i4").tobytes()
        cached = seqs[0].num_cached_tokens or 0
        state = ContextState(handle, prompt_i32, kv.output_prefix_len, cached,
                             pack_logprobs(export.prompt_logprobs) if export.prompt_logprobs else None).encode()
        if self.cfg.disagg_unsigned_context:  # (its caller may hold no secret: only one who does opens it)
            state = seal_state(self.cfg.disagg_secret or "", state)
        # TensorRT-LLM's orchestrator asks that its disagg_request_id be the pair's id, and reads it back
        ctx_id = kv.disagg_request_id if kv.disagg_request_id is not None else secrets.randbits(63)
        params = DisaggregatedParams(
            request_type="context_only", first_gen_tokens=[export.first[s.index] for s in seqs],
            first_gen_log_probs=[_wire_logprobs(export.first[s.index], export.logprobs[s.index]) for s in seqs]
            if len(export.logprobs) == len(seqs) else None,
            ctx_request_id=ctx_id, encoded_opaque_state=state, disagg_request_id=ctx_id)
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
        blocks = {pool: len({b for s in lease.seqs for b in getattr(s, pool) if b >= 0}) for pool in self._block_bytes}
        for seq in lease.seqs:
            self.scheduler.release(seq)
        LEASES.labels(how).inc()
        log_transfer(self._timing, lease.request_id, "send", lease.backend, lease.since, time.time(),
                     sum(n * self._block_bytes[pool] for pool, n in blocks.items()), sum(blocks.values()), how)

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

    # ---- generation side (engine/kv_import.py) and the step ----------------------------------------------------

    def admit(self) -> StepResult:
        """Starts the imports that fit now: the first tokens (and the choices they end) to emit this step."""
        self.poll()
        return self.imports.admit()

    def merged(self, first: StepResult, result: StepResult, samples: StepSamples | None
               ) -> tuple[StepResult, StepSamples | None]:
        """The step's outputs with imported requests' first tokens (and their logprobs) before its own."""
        return self.imports.merged(first, result, samples)


def _block_bytes(layout: KvLayout | None, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, int]:
    """Bytes of one block of each pool, over every layer's cache tensors there (what a lease's blocks hold)."""
    out: dict[str, int] = {}
    if layout is None:
        return out
    for layer, t in cache_tensors(caches):
        pool = layout.pools[layer]
        out[pool] = out.get(pool, 0) + layout.block_elements * t.element_size()
    return out


def _wire_logprobs(token: int, lp: TokenLogprobs) -> list[dict]:
    """A first token's logprobs as TensorRT-LLM's first_gen_log_probs holds one position's: {token_id, logprob,
    rank} of the sampled token, then of each of the most likely ones."""
    return [{"token_id": token, "logprob": lp.logprob, "rank": lp.rank}] + [
        {"token_id": t, "logprob": p, "rank": i + 1} for i, (t, p) in enumerate(zip(lp.top_ids, lp.top_logprobs))]
