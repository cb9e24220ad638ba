"""The engine process: one loop of take inputs, schedule, run the model, emit outputs."""
from __future__ import annotations

import ctypes
import logging
import os
import queue
import random
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import zmq

from engine.block_manager import BlockManager
from engine.grammar import Grammars, Unsatisfiable
from engine.kv_events import KvEventPublisher
from engine.kv_handoff import KvHandOff, exporter_for, importer_for
from engine.loader import load_model
from engine.model_runner import ModelRunner, StepSamples, kv_block_bytes, kv_pools
from engine.replay import ReplayRunner, load_recordings
from engine.sampler import TokenLogprobs
from engine.scheduler import Scheduler, StepResult
from engine.sequence import Sequence
from ipc.messages import (Abort, EngineInput, EngineRequest, Failed, Finished, Logprobs, PostprocInput, PromptLogprobs,
                          Ready, Started, StepOutputs, StepsTaken, SupervisorInput, Timings, bytes_to_ids,
                          ids_to_bytes)
from ipc.stats import EngineStats
from ipc.transport import PullChannel, PushChannel
from sluice import metrics
from sluice.config import ServerConfig
from sluice.disagg import endpoint

log = logging.getLogger("sluice.engine")
_IDLE_POLL_S = 0.25
_HELD_POLL_S = 0.01
_STALE_S = 1.0  # a postproc shard that takes no steps for this long is not waited for (it died)
_MAX_EARLY_ABORTS = 10_000
_MAX_FAILED_STEPS = 3  # steps failing in a row: the engine itself is broken, not one request
_REPLAY_KV_BLOCKS = 1 << 16  # nothing is stored: blocks are only accounted
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc mallopt parameters
_CHOICE_SEED_STRIDE = 0x9E3779B97F4A7C15  # choice i of a seeded request samples with its own stream


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def pick_dtype(name: str, hf_config: dict, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    declared = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
    return torch.float16 if declared == "float16" else torch.bfloat16


def num_kv_blocks(cfg: ServerConfig, model: torch.nn.Module, dtype: torch.dtype,
                  device: torch.device) -> tuple[int, int]:
    """(blocks of the main pool, blocks of the sliding-window layers' own pool, 0 if they have none)."""
    pools = kv_pools(model)
    window_layers = sum(pools[w] == "window_table" for w in model.layer_windows)
    window = next((w for w, name in pools.items() if name == "window_table"), None)
    # what the window pool can ever need: each running sequence's window plus one step's chunk
    window_need = cfg.max_num_seqs * (-(-(window - 1 + cfg.max_num_batched_tokens) // cfg.block_size) + 1) \
        if window else 0
    if cfg.num_kv_blocks:
        return cfg.num_kv_blocks, min(window_need, cfg.num_kv_blocks)
    budget = cfg.kv_cache_memory
    if not budget:
        budget = int(torch.cuda.mem_get_info(device)[0] * 0.85) if device.type == "cuda" else 1 << 30
    full = kv_block_bytes(model, cfg.block_size, dtype, model.kv_shape[0] - window_layers)
    if not window:
        return budget // full, 0
    windowed = kv_block_bytes(model, cfg.block_size, dtype, window_layers)
    window_blocks = min(window_need, budget // 2 // windowed)
    return (budget - window_blocks * windowed) // full, window_blocks


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
                               out.timings)
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


class Engine:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        hf = cfg.hf_config()
        device = pick_device(cfg.device)
        self.cpu_compute = cfg.runner != "replay" and device.type == "cpu"  # its kernels use every core
        dtype = pick_dtype(cfg.dtype, hf, device)
        exporter = exporter_for(cfg, dtype, device)  # a context worker's cache where its KV transport reads it
        if cfg.runner == "replay":
            blocks, window_blocks = cfg.num_kv_blocks or _REPLAY_KV_BLOCKS, 0
            recordings = load_recordings(cfg.replay_file) if cfg.replay_file else None
            self.runner = ReplayRunner(hf["vocab_size"], recordings, cfg.replay_step_ms / 1000)
        else:
            model = load_model(Path(cfg.model_path), dtype, device)
            blocks, window_blocks = num_kv_blocks(cfg, model, dtype, device)
            self.runner = ModelRunner(model, blocks, cfg.block_size, dtype, device, window_blocks,
                                      getattr(exporter, "alloc", None))
            log.info("engine: the LM head runs on %s", self.runner.lm_head.path)
            warm = self.runner.warm_up(max(cfg.max_num_batched_tokens, 1), cfg.max_num_seqs, cfg.max_model_len)
            log.info("engine: warmed up in %.2f s", warm)
        if blocks * cfg.block_size < cfg.max_model_len:
            raise SystemExit(f"the KV cache holds {blocks * cfg.block_size} tokens, less than max_model_len "
                             f"{cfg.max_model_len}: raise --kv-cache-memory / --num-kv-blocks or lower --max-model-len")
        hybrid = getattr(self.runner, "hybrid", False)
        window = self.runner.sliding_window
        if hybrid and window_blocks * cfg.block_size < window - 1 + cfg.max_num_batched_tokens + cfg.block_size:
            raise SystemExit(f"the sliding-window layers' pool ({window_blocks} blocks) cannot hold one window "
                             f"({window}) and a step ({cfg.max_num_batched_tokens} tokens): raise the KV budget "
                             "or lower --max-num-batched-tokens")
        self.scheduler = Scheduler(BlockManager(blocks, cfg.block_size, cfg.enable_prefix_caching),
                                   max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=max(cfg.max_num_batched_tokens, 1),
                                   max_model_len=cfg.max_model_len, sliding_window=self.runner.sliding_window,
                                   window_pool=BlockManager(window_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                                            "window_table")
                                   if hybrid else None)
        self.grammars = Grammars(cfg.model_path, hf["vocab_size"], cfg.grammar_backend)
        self.kv = KvHandOff(cfg, self.scheduler, self.runner, exporter, importer_for(cfg, self.runner),
                            lambda seq, message: self._ended.failed.append((seq, Failed(seq.request_id, message))))
        self.kv_events = KvEventPublisher(zmq.Context.instance(), endpoint(cfg, cfg.kv_events_port, bind=True),
                                          self.scheduler.bm) if cfg.kv_events else None
        # Constrained requests, in arrival order, while their grammar loads.
        self._held: list[tuple[EngineRequest, Future]] = []
        # Aborts that overtook their request (a client gone while it was rendering).
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        self._ended = Ended()
        self._failed_steps = 0
        log.info("engine: %s %s, %d KV blocks of %d tokens (+%d for sliding-window layers)", device, dtype, blocks,
                 cfg.block_size, window_blocks)

    def accept(self, msg: EngineInput) -> None:
        """Adds a request, or ends requests (Abort) or single choices (EndChoices)."""
        if isinstance(msg, EngineRequest):
            self._add(msg)
        elif isinstance(msg, Abort):
            self._abort(msg.request_ids)
        else:  # choices their postproc shard has finished already: nobody needs to hear of it
            for rid, index in msg.choices:
                self.scheduler.abort(rid, index)

    def _add(self, msg: EngineRequest) -> None:
        if self._early_aborts.pop(msg.request_id, 0) is None:
            return
        if msg.grammar:
            self._held.append((msg, self.grammars.load(msg.grammar)))  # admitted by admit_held()
            return
        self._start(msg)

    def _start(self, msg: EngineRequest, grammar: Future | None = None) -> None:
        seed = msg.sampling.seed if msg.sampling.seed is not None else random.getrandbits(63)
        prompt = bytes_to_ids(msg.prompt_token_ids).tolist()
        seqs: list[Sequence] = []
        for index in range(msg.n):
            seq = Sequence(msg.request_id, prompt, msg.sampling, seed=(seed + index * _CHOICE_SEED_STRIDE) % 2**63,
                           shard=msg.shard, postproc_spec=msg.postproc_spec, arrival_time=msg.arrival_time,
                           priority=msg.priority, cache_salt=msg.cache_salt, index=index,
                           leader=seqs[0] if seqs else None)
            seq.render_done_time = msg.render_done_time
            seqs.append(seq)
        if grammar is not None:
            try:
                compiled = grammar.result()
                for seq in seqs:
                    seq.grammar = self.grammars.state(compiled, msg.grammar_trigger, msg.sampling.stop_token_ids,
                                                      msg.grammar_param or "structured output")
            except Exception as e:  # xgrammar raises several types
                log.exception("structured output could not start for %s", msg.request_id)
                self._ended.failed.append((seqs[0], Failed(msg.request_id, f"structured output could not start: {e}")))
                return
        if msg.kv is not None:
            return self.kv.start(msg, seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    def _abort(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        held = [m.request_id for m, _ in self._held if m.request_id in ids]
        self._held = [(m, f) for m, f in self._held if m.request_id not in ids]
        for rid in ids.difference(held):
            self.kv.forget(rid)
            seqs = self.scheduler.abort(rid)
            if seqs:
                self._ended.aborted += seqs
            else:
                self._early_aborts[rid] = None
                if len(self._early_aborts) > _MAX_EARLY_ABORTS:
                    self._early_aborts.popitem(last=False)

    def fail(self, request_id: str, message: str) -> None:
        """Ends every choice of a request that cannot go on; its client gets an error, the others go on."""
        self.kv.forget(request_id)
        seqs = self.scheduler.abort(request_id)
        if seqs:
            self._ended.failed.append((seqs[0], Failed(request_id, message)))

    def take_ended(self) -> Ended:
        ended, self._ended = self._ended, Ended()
        return ended

    @property
    def held(self) -> bool:
        return bool(self._held)

    def admit_held(self) -> None:
        """Starts the held requests whose grammar has loaded (or failed to)."""
        if not self._held:
            return
        held, self._held = self._held, []
        for msg, grammar in held:
            if grammar.done():
                self._start(msg, grammar)
            else:
                self._held.append((msg, grammar))

    def step(self) -> tuple[StepResult, StepSamples | None]:
        """One step, with disaggregated serving's part: imported requests start (their first tokens go out
        before the step's own), exported ones park under a lease; and the prefix cache's events go out."""
        imported = self.kv.admit()
        result, samples = self._run_step()
        self.kv.park(result.exported)
        if self.kv_events is not None:
            self.kv_events.publish()
        return self.kv.merged(imported, result, samples)

    def _run_step(self) -> tuple[StepResult, StepSamples | None]:
        batch = self.scheduler.schedule()
        if batch is None:
            return StepResult(), None
        try:
            samples = self.runner.run(batch)
        except Exception:
            # One request's bad state must not take every request down with the engine; a step that keeps
            # failing means the engine itself is broken, and it exits (the server restarts).
            self._failed_steps += 1
            if self._failed_steps >= _MAX_FAILED_STEPS:
                raise
            log.exception("engine: a step failed: failing its requests")
            for rid in dict.fromkeys(seq.request_id for seq in batch.seqs):
                self.fail(rid, "internal error in the engine while running this request")
            return StepResult(), None
        self._failed_steps = 0
        result = self.scheduler.update(batch, samples.tokens)
        self._fail_grammars(batch.seqs, result)
        return result, samples

    def _fail_grammars(self, seqs: list[Sequence], result: StepResult) -> None:
        """Fails the requests whose grammar cannot go on. The step's token for such a choice is none the
        grammar chose (it may even be a stop id that ended it): the request fails, with nothing of the step."""
        failed = {s.request_id: s for s in seqs if s.grammar is not None and s.grammar.error is not None}
        if not failed:
            return
        result.new_tokens = [(s, t) for s, t in result.new_tokens if s.request_id not in failed]
        result.finished = [(s, r) for s, r in result.finished if s.request_id not in failed]
        for rid, seq in failed.items():
            error = seq.grammar.error
            self.kv.forget(rid)
            self.scheduler.abort(rid)
            if isinstance(error, Unsatisfiable):
                log.info("request %s ends: its constraints leave no way on (%s)", rid, error.message)
                self._ended.failed.append((seq, Failed(rid, error.message, 400, error.param)))
            else:
                log.error("structured output failed for %s: %s", rid, error)
                self._ended.failed.append((seq, Failed(rid, str(error))))


def keep_heap_memory() -> None:
    """Keeps large tensors on the heap. glibc maps each allocation above 32 MiB afresh and unmaps it when
    freed, so a step's vocabulary-sized temporaries (batch-64 float32 logits are 51 MB) pay page faults on
    every step: 16 ms at batch 64 here, more than the LM head itself. Without mmap'd chunks (and with
    trimming only above 2 GiB free) those pages are reused. The engine is the one process with such
    temporaries; elsewhere, or without glibc, this does nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    libc.mallopt(_M_MMAP_MAX, 0)
    libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)


def run_engine(cfg: ServerConfig) -> None:
    keep_heap_memory()
    engine = Engine(cfg)
    ctx = zmq.Context()
    addr = cfg.addresses
    inbox: PullChannel[EngineInput] = PullChannel(ctx, addr.engine, EngineInput)
    outbox = Outbox(ctx, cfg)
    stats = EngineStats(addr.stats_path)
    sched = engine.scheduler
    stats.set(kv_total_blocks=sched.bm.num_blocks, alive=1)
    ready = Ready("engine", 0, os.getpid(), engine.cpu_compute, kv_transfer_port=engine.kv.port,
                  kv_events_port=engine.kv_events.port if engine.kv_events else 0)
    PushChannel[SupervisorInput](ctx, addr.supervisor).put(ready)
    steps = tokens = 0
    step_time = step_seconds = 0.0
    while True:
        if len(sched) and not outbox.full():
            msgs = inbox.drain()
        else:  # idle or the postproc behind: block (briefly, while a request waits for its grammar or a shard)
            first = inbox.get(timeout=_HELD_POLL_S if engine.held or len(sched) else _IDLE_POLL_S)
            msgs = [first, *inbox.drain()] if first is not None else []
        for m in msgs:
            if isinstance(m, StepsTaken):
                outbox.taken(m)
            else:
                engine.accept(m)
        engine.admit_held()
        t0 = time.perf_counter()
        result, samples = engine.step() if not outbox.full() else (StepResult(), None)
        if samples is not None:
            steps += 1
            step_time = time.perf_counter() - t0
            step_seconds += step_time
        ended = engine.take_ended()
        if samples is not None or ended:
            outbox.emit(result, samples, ended)
            tokens += len(result.new_tokens)
        st = sched.stats
        stats.set(heartbeat=time.time(), num_running=len(sched.running), num_waiting=len(sched.waiting),
                  kv_used_blocks=sched.bm.num_used, num_steps=steps, num_preemptions=st.num_preemptions,
                  generated_tokens=tokens, prefix_queries=st.prefix_queries, prefix_hits=st.prefix_hits,
                  step_time=step_time, step_seconds=step_seconds)
        now = time.monotonic()
        if not len(sched) or now - metrics.LATER.at >= metrics.FLUSH_S:
            metrics.LATER.flush(now)  # the finished requests' timings, in a batch
