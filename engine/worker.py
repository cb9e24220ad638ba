"""The engine process: one loop of take inputs, schedule, run the model, emit outputs."""
from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch
import zmq

from engine.block_manager import BlockManager
from engine.loader import load_model
from engine.model_runner import ModelRunner, kv_block_bytes
from engine.scheduler import Scheduler, StepResult
from engine.sequence import Sequence
from ipc.messages import (Abort, EngineInput, EngineRequest, PostprocInput, Ready, Started, StepOutputs,
                          SupervisorInput, bytes_to_ids, ids_to_bytes)
from ipc.stats import EngineStats
from ipc.transport import PullChannel, PushChannel
from sluice.config import ServerConfig

log = logging.getLogger("sluice.engine")
_IDLE_POLL_S = 0.25
_MAX_EARLY_ABORTS = 10_000


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


def num_kv_blocks(cfg: ServerConfig, model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    if cfg.num_kv_blocks:
        return cfg.num_kv_blocks
    budget = cfg.kv_cache_memory
    if not budget:
        budget = int(torch.cuda.mem_get_info(device)[0] * 0.85) if device.type == "cuda" else 1 << 30
    return budget // kv_block_bytes(model, cfg.block_size, dtype)


class Outbox:
    """Encodes and sends step outputs on a thread, off the model's critical path."""

    def __init__(self, ctx: zmq.Context, cfg: ServerConfig) -> None:
        self._shards = [PushChannel[PostprocInput](ctx, cfg.addresses.postproc(k), **cfg.bulk())
                        for k in range(cfg.postproc_workers)]
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="engine-outbox", daemon=True).start()

    def emit(self, result: StepResult, aborted: list[Sequence]) -> None:
        per_shard: dict[int, tuple[list, list, list, list]] = {}
        for seq, token in result.new_tokens:
            started, ids, tokens, _ = per_shard.setdefault(seq.shard, ([], [], [], []))
            if not seq.started:
                seq.started = True
                started.append(Started(seq.request_id, seq.postproc_spec, seq.num_prompt_tokens,
                                       seq.num_cached_tokens))
            ids.append(seq.request_id)
            tokens.append(token)
        finished = result.finished + [(seq, "abort") for seq in aborted if seq.started]
        for seq, reason in finished:
            per_shard.setdefault(seq.shard, ([], [], [], []))[3].append((seq.request_id, reason))
        for shard, (started, ids, tokens, done) in per_shard.items():
            self._queue.put((shard, StepOutputs(started, ids, ids_to_bytes(tokens), done)))

    def _run(self) -> None:
        while True:
            shard, msg = self._queue.get()
            self._shards[shard].put(msg)


class Engine:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        hf = cfg.hf_config()
        device = pick_device(cfg.device)
        dtype = pick_dtype(cfg.dtype, hf, device)
        model = load_model(Path(cfg.model_path), dtype, device)
        blocks = num_kv_blocks(cfg, model, dtype, device)
        if blocks * cfg.block_size < cfg.max_model_len:
            raise SystemExit(f"the KV cache holds {blocks * cfg.block_size} tokens, less than max_model_len "
                             f"{cfg.max_model_len}: raise --kv-cache-memory / --num-kv-blocks or lower --max-model-len")
        self.runner = ModelRunner(model, blocks, cfg.block_size, dtype, device)
        self.scheduler = Scheduler(BlockManager(blocks, cfg.block_size), max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=max(cfg.max_num_batched_tokens, 1),
                                   max_model_len=cfg.max_model_len)
        # Aborts that overtook their request (a client gone while it was rendering).
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        log.info("engine: %s %s, %d KV blocks of %d tokens", device, dtype, blocks, cfg.block_size)

    def accept(self, msg: EngineInput) -> list[Sequence]:
        """Adds a request or applies an abort; returns the sequences aborted."""
        if isinstance(msg, EngineRequest):
            if self._early_aborts.pop(msg.request_id, 0) is None:
                return []
            seed = msg.sampling.seed if msg.sampling.seed is not None else random.getrandbits(63)
            self.scheduler.add(Sequence(msg.request_id, bytes_to_ids(msg.prompt_token_ids).tolist(), msg.sampling,
                                        seed=seed, shard=msg.shard, postproc_spec=msg.postproc_spec,
                                        arrival_time=msg.arrival_time))
            return []
        assert isinstance(msg, Abort)
        aborted = []
        for rid in msg.request_ids:
            seq = self.scheduler.abort(rid)
            if seq is not None:
                aborted.append(seq)
            else:
                self._early_aborts[rid] = None
                if len(self._early_aborts) > _MAX_EARLY_ABORTS:
                    self._early_aborts.popitem(last=False)
        return aborted

    def step(self) -> StepResult | None:
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        return self.scheduler.update(batch, self.runner.run(batch))


def run_engine(cfg: ServerConfig) -> None:
    engine = Engine(cfg)
    ctx = zmq.Context()
    addr = cfg.addresses
    inbox: PullChannel[EngineInput] = PullChannel(ctx, addr.engine, EngineInput)
    outbox = Outbox(ctx, cfg)
    stats = EngineStats(addr.stats_path)
    sched = engine.scheduler
    stats.set(kv_total_blocks=sched.bm.num_blocks, alive=1)
    PushChannel[SupervisorInput](ctx, addr.supervisor).put(Ready("engine", 0, os.getpid()))
    steps = tokens = 0
    while True:
        if len(sched):
            msgs = inbox.drain()
        else:
            first = inbox.get(timeout=_IDLE_POLL_S)
            msgs = [first, *inbox.drain()] if first is not None else []
        aborted = [s for m in msgs for s in engine.accept(m)]
        result = engine.step() or StepResult()
        if result.new_tokens or result.finished or aborted:
            outbox.emit(result, aborted)
            steps += 1
            tokens += len(result.new_tokens)
        stats.set(heartbeat=time.time(), num_running=len(sched.running), num_waiting=len(sched.waiting),
                  kv_used_blocks=sched.bm.num_used, num_steps=steps, num_preemptions=sched.num_preemptions,
                  generated_tokens=tokens)
