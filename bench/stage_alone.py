"""Each front stage's own CPU, in process: no sockets, no other process on the cores.

    python -m bench.stage_alone [--streams 64] [--steps-per-call 2] [--rounds 5]

- postproc: a `Shard` fed `--streams` streams of the replayed gpt-oss output (bench/ceiling.py's recording,
  harmony parsing, chat chunks), msgpack-decoded `StepOutputs`, `--steps-per-call` steps a call, the frames
  encoded as the worker sends them: CPU microseconds a token.
- engine: an `Engine` on the replay runner stepping `--streams` requests to their end, each step's outputs
  built and encoded: microseconds a token and a step.
- render: `ChatCore.render` of wrk's chat request bodies (bench/wrk_sse.lua's shape), the engine request
  encoded: microseconds a request.

Best of `--rounds` (process time). Beside `bench.ceiling`'s CPU per 1,000 tokens of each stage in the server,
the difference is what being one of several busy processes costs each stage (bench/RESULTS.md#front-stage-cpu).
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import msgspec
from tokenizers import Tokenizer

from bench.ceiling import MODEL, harmony_recording
from sluice.app.builtin_models import resolve_model
from sluice.base.config import ServerConfig
from sluice.base.harmony_vocab import harmony_encoding
from sluice.engine.engine import Engine
from sluice.engine.outputs import step_outputs
from sluice.ipc.messages import (EngineRequest, Finished, PostprocSpec, RenderJob, SamplingParams, Started, StepOutputs,
                                 ids_to_bytes)
from sluice.postproc.worker import Shard
from sluice.render.worker import build_core

_WORDS = ["time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "river", "market"]


def _best(rounds: int, run) -> float:
    run()  # warm
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        run()
        best = min(best, time.process_time() - t0)
    return best


def postproc(model: Path, tokens: list[int], streams: int, per_call: int, rounds: int) -> float:
    shard = Shard(Tokenizer.from_file(str(model / "tokenizer.json")))
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(StepOutputs)
    counter = iter(range(1 << 30))

    def run() -> None:
        rids = [f"r{next(counter)}" for _ in range(streams)]
        specs = [Started(r, msgspec.msgpack.encode(PostprocSpec(
            request_id=r, endpoint="chat", model=MODEL, created=1, reply_to="ipc://x", stream=True,
            include_usage=True, output_mode="tokens", parsers=["harmony"])), num_prompt_tokens=100) for r in rids]
        wire = [enc.encode(StepOutputs(specs if t == 0 else [], rids, ids_to_bytes([0] * streams),
                                       ids_to_bytes([tok] * streams),
                                       [Finished(r, 0, "stop_token") for r in rids] if t == len(tokens) - 1 else []))
                for t, tok in enumerate(tokens)]
        for i in range(0, len(wire), per_call):
            frames, _ = shard.on_steps([dec.decode(w) for w in wire[i:i + per_call]])
            for batch in frames.values():
                enc.encode(batch)

    return _best(rounds, run) / (streams * len(tokens))


def engine(cfg: ServerConfig, streams: int, rounds: int) -> tuple[float, float]:
    eng = Engine(cfg)
    enc = msgspec.msgpack.Encoder()
    spec = msgspec.msgpack.encode(PostprocSpec(request_id="x", endpoint="chat", model=MODEL, created=1,
                                               reply_to="ipc://x", stream=True))
    counter = iter(range(1 << 30))
    counts = [0, 0]  # steps, tokens of the last run

    def run() -> None:
        for i in range(streams):
            eng.accept(EngineRequest(f"r{next(counter)}", ids_to_bytes(list(range(1000 + i, 1150 + i))),
                                     SamplingParams(max_tokens=4096), 0, spec))
        counts[:] = [0, 0]
        while len(eng.scheduler):
            result, samples = eng.step()
            for msg in step_outputs(result, samples, eng.take_ended()).values():
                enc.encode(msg)
            counts[0] += 1
            counts[1] += len(result.new_tokens)

    seconds = _best(rounds, run)
    return seconds / counts[1], seconds / counts[0]


def render(cfg: ServerConfig, requests: int, rounds: int) -> float:
    core = build_core(cfg)
    rng = random.Random(12345)
    jobs = [RenderJob(f"r{i}", "chat", msgspec.json.encode({
        "model": MODEL, "messages": [{"role": "user", "content": " ".join(rng.choice(_WORDS) for _ in range(100))}],
        "max_tokens": 256, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
        "ignore_eos": True}), "ipc://x", time.time()) for i in range(requests)]
    enc = msgspec.msgpack.Encoder()
    return _best(rounds, lambda: [enc.encode(core.render(job)) for job in jobs]) / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--steps-per-call", type=int, default=2, help="steps a postproc drain takes at once")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model = resolve_model(MODEL)
    harmony_encoding()
    with tempfile.TemporaryDirectory() as tmp:
        recording = str(Path(tmp) / "recording.jsonl")
        harmony_recording(recording, args.output_len)
        tokens = json.loads(Path(recording).read_text().splitlines()[0])
        cfg = ServerConfig(model=MODEL, model_path=str(model), served_model_names=[MODEL], runtime_dir=tmp,
                           postproc_workers=1, runner="replay", replay_file=recording, max_model_len=4096,
                           max_num_seqs=1024, num_kv_blocks=65536)
        per_token = postproc(model, tokens, args.streams, args.steps_per_call, args.rounds)
        print(f"postproc: {per_token * 1e6:.2f} us a token ({args.streams} streams, "
              f"{args.steps_per_call} steps a call)")
        token, step = engine(cfg, args.streams, args.rounds)
        print(f"engine:   {token * 1e6:.2f} us a token, {step * 1e6:.0f} us a step ({args.streams} rows, "
              "replay runner)")
        print(f"render:   {render(cfg, 64, args.rounds) * 1e6:.0f} us a request (gpt-oss harmony, wrk's chat body)")


if __name__ == "__main__":
    main()
