"""Postproc process: owns a shard of request ids; tokens in, frames out."""
from __future__ import annotations

import json
import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq
from tokenizers import Tokenizer

from sluice.base import hooks, metrics, tracing
from sluice.base.config import ServerConfig
from sluice.ipc.messages import (Abort, EndChoices, EngineInput, Failed, Failure, Frame, Frames, IngressGone,
                                 IngressInput, PostprocInput, PostprocSpec, Ready, StepOutputs, StepsTaken,
                                 SupervisorInput, bytes_to_ids)
from sluice.ipc.stats import BEAT_S, StageClocks
from sluice.ipc.transport import PullChannel, PushChannel, PushPool
from sluice.postproc.openai_frames import unpack
from sluice.postproc.request import RequestOutput

_spec_decoder = msgspec.msgpack.Decoder(PostprocSpec)
log = logging.getLogger("sluice.postproc")
# Tokens framed per message to the ingress when steps queued up: frames are not held back for a whole backlog,
# which bounds the gaps between a stream's events; two steps of 256 rows still make one part, so a request's
# tokens from the engine's window (--max-steps-ahead 2) go out in one event at 256 streams as at 64 (bench/ceiling.py;
# bench/RESULTS.md#pipeline-ceiling).
_PART_TOKENS = 512


@dataclass
class _Feed:
    """What feeding one batch of steps to a shard produced."""

    touched: dict[str, RequestOutput] = field(default_factory=dict)  # requests that got tokens
    fed: dict[tuple[str, int], None] = field(default_factory=dict)  # (request, choice) fed tokens, in order
    failed: dict[str, tuple[RequestOutput, Failure]] = field(default_factory=dict)  # request -> (state, why)
    ended_choices: list[tuple[str, int]] = field(default_factory=list)  # ended here, before the engine did
    aborts: list[str] = field(default_factory=list)  # requests this shard failed, for the engine to drop
    gaps: list[float] = field(default_factory=list)  # inter-token gaps


def _failure(f: Failed) -> Failure:
    """What the client hears of a request the engine failed: its own constraints' error, or the engine's."""
    if f.status >= 500:
        return Failure(f.status, f.message, "internal_error")
    return Failure(f.status, f.message, param=f.param)


class Shard:
    def __init__(self, tokenizer: Tokenizer, kv_timing_output: str | None = None,
                 hook: hooks.PostProcessorHook | None = None, spans: tracing.Exporter | None = None) -> None:
        """`hook`: --post-processor-hook; `spans`: where finished requests' spans go (--otlp-traces-endpoint)."""
        self.tokenizer = tokenizer
        self.hook, self.spans = hook, spans
        self.requests: dict[str, RequestOutput] = {}
        self._token_text: dict[int, str] = {}
        self._timing_file = open(kv_timing_output, "a", buffering=1) if kv_timing_output else None
        self._gaps: list[float] = []  # inter-token gaps not yet in the ITL histogram

    def text_of(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def on_steps(self, msgs: list[StepOutputs], coalesce: bool = True) -> tuple[dict[str, list[Frame]],
                                                                                 list[EngineInput]]:
        """Frames per ingress address for the steps given (oldest first), one a request, and what the engine
        must end: the choices this shard finished (stop strings, malformed output) and the requests it
        failed. Coalescing, a request that got tokens in several of these steps (the shard fell behind the
        engine) gets them in one chunk: under load it sends fewer, larger events; without, it gets a chunk
        a step, all in its one frame."""
        step = _Feed()
        data: dict[str, bytes] = defaultdict(bytes)
        for msg in msgs:
            self._feed(msg, step)
            if not coalesce:
                self._chunk(step, data)
        self._chunk(step, data)
        touched = step.touched
        out: dict[str, list[Frame]] = defaultdict(list)
        for rid, (req, failure) in step.failed.items():
            if rid in data:  # chunks of its earlier steps (not coalescing): they went out before it failed
                out[req.spec.reply_to].append(req.frame(data[rid]))
            out[req.spec.reply_to].append(req.frame(b"", True, failure))
        for rid, req in touched.items():
            if req.done:
                del self.requests[rid]
                self._finished(req)
                out[req.spec.reply_to].append(req.final(data[rid]))
            elif data[rid]:
                out[req.spec.reply_to].append(req.frame(data[rid]))
        self._gaps += step.gaps
        if not self.requests or time.monotonic() - metrics.LATER.at >= metrics.FLUSH_S:
            self._record_metrics()
        to_engine: list[EngineInput] = []
        if step.ended_choices:
            to_engine.append(EndChoices(step.ended_choices))
        if step.aborts:
            to_engine.append(Abort(step.aborts))
        return out, to_engine

    @staticmethod
    def _chunk(step: "_Feed", data: dict[str, bytes]) -> None:
        """Adds the chunks of the choices fed since the last call to their requests' data."""
        touched = step.touched
        for rid, index in step.fed:
            if rid in touched:
                data[rid] += touched[rid].chunk(index)
        step.fed.clear()

    def _record_metrics(self) -> None:
        """Each multiprocess metric update checks the pid and packs into an mmap: per step that costs more
        than framing the step's tokens, so the per-step ones, and the finished requests' (metrics.LATER), go
        in at most every metrics.FLUSH_S (and whenever the shard empties, so an idle server's metrics are
        complete)."""
        metrics.observe_many(metrics.ITL, self._gaps)
        metrics.IN_FLIGHT.labels("postproc").set(len(self.requests))
        metrics.LATER.flush(time.monotonic())
        self._gaps = []

    def _feed(self, msg: StepOutputs, step: "_Feed") -> None:
        touched = step.touched
        for s in msg.started:
            self.requests[s.request_id] = RequestOutput(_spec_decoder.decode(s.postproc_spec), self.tokenizer, s,
                                                        self.text_of, self.hook)
        for f in msg.failed:  # the engine has freed them: their tokens of this step are not shown
            if (req := self.requests.pop(f.request_id, None)) is not None:
                touched.pop(f.request_id, None)
                step.failed[f.request_id] = (req, _failure(f))
        for rid in msg.aborted:  # the ingress asked for it: nobody is listening
            if self.requests.pop(rid, None) is not None:
                touched.pop(rid, None)
        for chunk in msg.prompt_logprobs:
            req = self.requests.get(chunk.request_id)
            if req is not None:
                req.framer.add_prompt_logprobs(chunk.start, bytes_to_ids(chunk.token_ids).tolist(),
                                               unpack(chunk.values))
        for t in msg.timings:
            if (req := self.requests.get(t.request_id)) is not None:
                req.timings.append(t)
        for p in msg.predicted:
            if (req := self.requests.get(p.request_id)) is not None:
                req.predicted(p.accepted, p.rejected)
        verdicts = {(f.request_id, f.index): f.reason for f in msg.finished}
        logprobs = {pos: unpack(lp)[0] for pos, lp in msg.logprobs}
        indices = bytes_to_ids(msg.indices).tolist()
        # a choice with several tokens in the step (drafted) has its verdict on the last
        last = {key: pos for pos, key in enumerate(zip(msg.request_ids, indices)) if key in verdicts} \
            if msg.predicted and verdicts else None
        now = time.time()
        requests, fed, gaps = self.requests, step.fed, step.gaps
        for pos, (rid, index, token) in enumerate(zip(msg.request_ids, indices, bytes_to_ids(msg.token_ids).tolist())):
            req = requests.get(rid)
            if req is None:
                continue
            verdict = verdicts.get((rid, index)) if verdicts else None
            if last is not None and verdict is not None and last[rid, index] != pos:
                verdict = None
            try:
                finish = req.feed(index, token, verdict, logprobs.get(pos) if logprobs else None, gaps, now)
            except Exception:  # one request's bad state must not take the shard down
                log.exception("postproc failed for %s", rid)
                step.failed[rid] = (requests.pop(rid), Failure(500, "internal error while producing the output",
                                                              "internal_error"))
                step.aborts.append(rid)
                touched.pop(rid, None)
                continue
            touched[rid] = req
            fed[(rid, index)] = None
            if finish is not None and verdict is None:  # ended here (stop string, ...)
                step.ended_choices.append((rid, index))

    def drop_destination(self, address: str) -> list[str]:
        """Forgets the requests whose frames go to `address`; returns their ids."""
        gone = [rid for rid, req in self.requests.items() if req.spec.reply_to == address]
        for rid in gone:
            del self.requests[rid]
        return gone

    def _finished(self, req: RequestOutput) -> None:
        summary = req.summary()
        later = metrics.LATER
        for choice in req.choices:
            later.inc(metrics.REQUEST_SUCCESS, 1, str(choice.finish_reason))
        later.inc(metrics.PROMPT_TOKENS, summary["prompt_tokens"])
        later.inc(metrics.GENERATION_TOKENS, summary["completion_tokens"])
        later.observe(metrics.E2E, summary["e2e_ms"] / 1000)
        log.info("request done", extra={"fields": summary})
        if self._timing_file is not None:
            self._timing_file.write(json.dumps(summary) + "\n")
        if self.spans is not None:
            self._export(req, summary)

    def _export(self, req: RequestOutput, summary: dict) -> None:
        times = {name: summary[name] for name in ("arrival_time", "render_done_time", "first_scheduled_time",
                                                  "first_token_time", "last_token_time")}
        attributes = {"sluice.request_id": req.spec.request_id, "sluice.endpoint": req.spec.endpoint,
                      "gen_ai.request.model": req.spec.model, "gen_ai.usage.input_tokens": summary["prompt_tokens"],
                      "gen_ai.usage.output_tokens": summary["completion_tokens"],
                      "gen_ai.response.finish_reasons": [str(r) for r in summary["finish_reasons"]]}
        try:
            assert self.spans is not None
            self.spans.export(req.spec.trace, {**times, "done_time": times["arrival_time"] + summary["e2e_ms"] / 1000},
                              attributes)
        except Exception:  # (tracing must not take the shard down)
            log.exception("exporting the spans of %s failed", req.spec.request_id)


def run_postproc(cfg: ServerConfig, index: int) -> None:
    if cfg.output_mode == "tokens":  # (gpt-oss through harmony: its token parser's vocabulary)
        from sluice.base.harmony_vocab import harmony_encoding

        harmony_encoding()  # now, not on the first request
    shard = Shard(Tokenizer.from_file(str(Path(cfg.model_path) / "tokenizer.json")), cfg.kv_timing_output,
                  hooks.load(cfg.post_processor_hook, "--post-processor-hook") if cfg.post_processor_hook else None,
                  tracing.Exporter.otlp(cfg.otlp_traces_endpoint) if cfg.otlp_traces_endpoint else None)
    ctx = zmq.Context()
    addr = cfg.addresses
    inbox: PullChannel[PostprocInput] = PullChannel(ctx, addr.postproc(index), PostprocInput)
    engine: PushChannel[EngineInput] = PushChannel(ctx, addr.engine)
    replies: PushPool[IngressInput] = PushPool(ctx, **cfg.bulk())
    clocks = StageClocks(addr.stage_clocks_path, cfg.render_workers, cfg.postproc_workers)
    PushChannel[SupervisorInput](ctx, addr.supervisor).put(Ready("postproc", index, os.getpid()))
    while True:
        clocks.beat("postproc", index)
        if (first := inbox.get(BEAT_S)) is None:
            continue
        msgs = [first, *inbox.drain()]  # all that waits: steps that queued up go out in one message
        for msg in msgs:
            if isinstance(msg, IngressGone):
                gone = shard.drop_destination(msg.address)
                if gone:
                    engine.put(Abort(gone))
                replies.drop(msg.address)
        steps = [m for m in msgs if isinstance(m, StepOutputs)]
        if steps:  # now, before framing them: the engine's next step overlaps this shard's work on these
            engine.put(StepsTaken(index, len(steps)))
        # Coalescing: a request's tokens from those steps in one event; without: an event per step still. Either
        # way a request's events go in one frame (its relay would write them in one send: they come together).
        for part in parts(steps, _PART_TOKENS):
            clocks.beat("postproc", index)  # (one part is one job: one that takes past its stall limit is stuck)
            frames_by_address, to_engine = shard.on_steps(part, cfg.coalesce_frames)
            for request in to_engine:
                engine.put(request)
            for address, frames in frames_by_address.items():
                replies.get(address).put(Frames(frames))


def parts(steps: list[StepOutputs], tokens: int) -> list[list[StepOutputs]]:
    """The steps in order, in parts of at most `tokens` tokens (or one step): a backlog goes out part by part,
    each part's frames as soon as they are made, not after the whole of it."""
    out: list[list[StepOutputs]] = [[]]
    size = 0
    for step in steps:
        n = len(step.request_ids)
        if out[-1] and size + n > tokens:
            out.append([])
            size = 0
        out[-1].append(step)
        size += n
    return out
