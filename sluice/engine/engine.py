"""The engine: its model runner (or the replay runner), scheduler, grammars and KV hand-off, and what it
does with each input (a request, an abort) and each step. The process around it is engine/worker.py."""
from __future__ import annotations

import logging
import os
import random
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path

import torch
import zmq

from sluice.base.config import ServerConfig
from sluice.base.disagg import endpoint
from sluice.engine.block_manager import BlockManager
from sluice.engine.grammar import Grammars, Unsatisfiable
from sluice.engine.kv_budget import num_kv_blocks
from sluice.engine.kv_events import KvEventPublisher
from sluice.engine.kv_handoff import KvHandOff, exporter_for, importer_for
from sluice.engine.loader import load_model
from sluice.engine.model_runner import ModelRunner, StepSamples
from sluice.engine.outputs import Ended
from sluice.engine.prediction import Prediction, can_draft
from sluice.engine.replay import ReplayRunner, load_recordings
from sluice.engine.scheduler import Scheduler, StepResult
from sluice.engine.sequence import Sequence
from sluice.engine.threads import ThreadTuner
from sluice.ipc.messages import Abort, EndChoices, EngineInput, EngineRequest, Failed, Ready, bytes_to_ids

log = logging.getLogger("sluice.engine")
_MAX_EARLY_ABORTS = 10_000
_MAX_FAILED_STEPS = 3  # steps failing in a row: the engine itself is broken, not one request
_REPLAY_KV_BLOCKS = 1 << 16  # nothing is stored: blocks are only accounted
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


# --kv-cache-dtype's fp8 names (vLLM's): fp8 is e4m3, finite (no infinities, more precision than e5m2)
_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def pick_kv_dtype(name: str, dtype: torch.dtype, model: torch.nn.Module | None) -> torch.dtype:
    """--kv-cache-dtype: auto is the activations' dtype, but float16 for a model whose linears are quantized
    under float32 activations (a GGUF file's, GPTQ / AWQ / int8 checkpoints', --quantization's): llama.cpp's
    cache for those files, and half the bytes every decode step's attention reads
    (bench/RESULTS.md#kv-cache-dtype)."""
    if name != "auto":
        return _FP8.get(name) or getattr(torch, name)
    return torch.float16 if quantized(model) and dtype == torch.float32 else dtype


def warn_dtype(device: torch.device, dtype: torch.dtype, model: torch.nn.Module | None) -> None:
    """Quantized linears on the CPU under activations other than float32 run, slower: the log says so."""
    if device.type == "cpu" and dtype != torch.float32 and quantized(model):
        log.warning("quantized linears under --dtype %s: their CPU kernels and the step in one call take float32 "
                    "rows, so each linear converts its rows and the layers run op by op (half the decode speed "
                    "of a W8A8 checkpoint, bench/JOURNAL.md); --dtype float32 (auto's choice on the CPU) is faster",
                    str(dtype).removeprefix("torch."))


def quantized(model: torch.nn.Module | None) -> bool:
    """Whether some of the model's linears hold quantized weights (engine/quant.py's set_quantized)."""
    return model is not None and any(getattr(m, "quant", None) is not None for m in model.modules())


def cpu_threads(spec: str) -> ThreadTuner | None:
    """--cpu-threads: a number sets torch's (and so the C kernels') thread count; auto starts from every core's
    and lets each batch size's steps run on one where that measures faster (engine/threads.py)."""
    if spec != "auto":
        torch.set_num_threads(int(spec))
        return None
    most = torch.get_num_threads()
    return ThreadTuner(most, torch.set_num_threads) if most > 1 else None


class Engine:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        hf = cfg.hf_config()
        device = pick_device(cfg.device)
        self.cpu_compute = cfg.runner != "replay" and device.type == "cpu"  # its kernels use every core
        self.threads = cpu_threads(cfg.cpu_threads) if self.cpu_compute else None  # (before the warm-up)
        dtype = pick_dtype(cfg.dtype, hf, device)
        model = None if cfg.runner == "replay" else load_model(Path(cfg.model_path), dtype, device, cfg.quantization)
        kv_dtype = pick_kv_dtype(cfg.kv_cache_dtype, dtype, model)
        warn_dtype(device, dtype, model)
        exporter = exporter_for(cfg, kv_dtype, device)  # a context worker's cache where its KV transport reads it
        self.runner: ModelRunner | ReplayRunner
        if model is None:
            blocks, window_blocks = cfg.num_kv_blocks or _REPLAY_KV_BLOCKS, 0
            recordings = load_recordings(cfg.replay_file) if cfg.replay_file else None
            self.runner = ReplayRunner(hf["vocab_size"], recordings, cfg.replay_step_ms / 1000)
        else:
            blocks, window_blocks = num_kv_blocks(cfg, model, kv_dtype, device)
            runner = self.runner = ModelRunner(model, blocks, cfg.block_size, dtype, device, window_blocks,
                                               getattr(exporter, "alloc", None), kv_dtype)
            log.info("engine: the LM head runs on %s", runner.lm_head.path)
            warm = runner.warm_up(max(cfg.max_num_batched_tokens, 1), cfg.max_num_seqs, cfg.max_model_len)
            log.info("engine: warmed up in %.2f s", warm)
        if blocks * cfg.block_size < cfg.max_model_len:
            raise SystemExit(f"the KV cache holds {blocks * cfg.block_size} tokens, less than max_model_len "
                             f"{cfg.max_model_len}: raise --kv-cache-memory / --num-kv-blocks or lower --max-model-len")
        hybrid = getattr(self.runner, "hybrid", False)
        window = self.runner.sliding_window or 0
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
                                   if hybrid else None,
                                   # (the replay runner samples no draft's rows)
                                   max_draft_tokens=0 if cfg.runner == "replay" else cfg.prediction_draft_tokens)
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
        log.info("engine: %s %s, %d KV blocks of %d tokens in %s (+%d for sliding-window layers)", device, dtype,
                 blocks, cfg.block_size, str(kv_dtype).removeprefix("torch."), window_blocks)

    def ready(self) -> Ready:
        """What the engine tells the supervisor once it can take requests."""
        return Ready("engine", 0, os.getpid(), self.cpu_compute, kv_transfer_port=self.kv.port,
                     kv_events_port=self.kv_events.port if self.kv_events else 0)

    def accept(self, msg: EngineInput) -> None:
        """Adds a request, or ends requests (Abort) or single choices (EndChoices)."""
        if isinstance(msg, EngineRequest):
            self._add(msg)
        elif isinstance(msg, Abort):
            self._abort(msg.request_ids)
        elif isinstance(msg, EndChoices):  # choices their shard has finished already: nobody needs to hear of it
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
        if msg.prediction and not msg.grammar and can_draft(msg.sampling):  # (a grammar's output: not drafted)
            predicted = bytes_to_ids(msg.prediction).tolist()
            for seq in seqs:
                seq.prediction = Prediction(predicted)
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
        self.kv.park(result, samples)
        if self.kv_events is not None:
            self.kv_events.publish()
        return self.kv.merged(imported, result, samples)

    def _run_step(self) -> tuple[StepResult, StepSamples | None]:
        batch = self.scheduler.schedule()
        if batch is None:
            return StepResult(), None
        rows = len(batch.seqs)
        if self.threads is not None:
            self.threads.threads_for(rows)
        try:
            t0 = time.perf_counter()
            samples = self.runner.run(batch)
            if self.threads is not None and max(batch.num_new_tokens) == 1:  # (a decode step: its time is its size's)
                self.threads.record(rows, time.perf_counter() - t0)
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
        failed = {s.request_id: (s, error) for s in seqs if s.grammar is not None and (error := s.grammar.error)}
        if not failed:
            return
        result.new_tokens = [(s, t) for s, t in result.new_tokens if s.request_id not in failed]
        result.finished = [(s, r) for s, r in result.finished if s.request_id not in failed]
        for rid, (seq, error) in failed.items():
            self.kv.forget(rid)
            self.scheduler.abort(rid)
            if isinstance(error, Unsatisfiable):
                log.info("request %s ends: its constraints leave no way on (%s)", rid, error.message)
                self._ended.failed.append((seq, Failed(rid, error.message, 400, error.param)))
            else:
                log.error("structured output failed for %s: %s", rid, error)
                self._ended.failed.append((seq, Failed(rid, str(error))))
