"""Postproc process: owns a shard of request ids; tokens in, frames out."""
from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import msgspec
import zmq
from tokenizers import Tokenizer

from ipc.messages import (Abort, EngineInput, Frames, IngressInput, PostprocInput, PostprocSpec, Ready,
                          StepOutputs, SupervisorInput, bytes_to_ids)
from ipc.transport import PullChannel, PushChannel, PushPool
from postproc.request import RequestOutput
from sluice.config import ServerConfig

_spec_decoder = msgspec.msgpack.Decoder(PostprocSpec)


class Shard:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestOutput] = {}

    def on_step(self, msg: StepOutputs) -> tuple[dict[str, list], list[str]]:
        """Frames per ingress address, and the requests a stop string ended (to abort in the engine)."""
        for s in msg.started:
            spec = _spec_decoder.decode(s.postproc_spec)
            self.requests[s.request_id] = RequestOutput(spec, self.tokenizer, s.num_prompt_tokens)
        finished = dict(msg.finished)
        out: dict[str, list] = defaultdict(list)
        stopped: list[str] = []
        for rid, token in zip(msg.request_ids, bytes_to_ids(msg.token_ids).tolist()):
            req = self.requests.get(rid)
            if req is None:  # a token already in flight when a stop string ended the request
                continue
            frame = req.on_token(token, finished.get(rid))
            if frame is not None:
                out[req.spec.reply_to].append(frame)
                if frame.done:
                    del self.requests[rid]
                    if req.stopped_by_string and rid not in finished:
                        stopped.append(rid)
        for rid, reason in msg.finished:
            if reason == "abort":  # the ingress asked for it: nobody is listening
                self.requests.pop(rid, None)
        return out, stopped


def run_postproc(cfg: ServerConfig, index: int) -> None:
    shard = Shard(Tokenizer.from_file(str(Path(cfg.model_path) / "tokenizer.json")))
    ctx = zmq.Context()
    addr = cfg.addresses
    inbox: PullChannel[PostprocInput] = PullChannel(ctx, addr.postproc(index), PostprocInput)
    engine: PushChannel[EngineInput] = PushChannel(ctx, addr.engine)
    replies: PushPool[IngressInput] = PushPool(ctx, **cfg.bulk())
    PushChannel[SupervisorInput](ctx, addr.supervisor).put(Ready("postproc", index, os.getpid()))
    while True:
        out, stopped = shard.on_step(inbox.get())
        if stopped:
            engine.put(Abort(stopped))
        for address, frames in out.items():
            replies.get(address).put(Frames(frames))
