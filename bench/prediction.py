"""Predicted outputs as a speculative draft: decode tokens/s of the engine alone (scheduler and paged runner,
no server) for greedy requests without a prediction, with their own output as the prediction (every draft
token right), and with random tokens (a useless prediction: drafts stop at the first miss, until the output's
last tokens turn up in it again).

    python -m bench.prediction [--model builtin:tiny-chat] [--batches 1,8] [--new-tokens 64] [--prompt-len 32]
                               [--draft-tokens 8] [--rounds 3]
    python -m bench.prediction --model llama-135m       # a bench checkpoint (bench/checkpoints.py)

Each round runs the three cases one after another (interleaved, as the machine's speed drifts); the figure is
the median round's. The outputs with a prediction are checked against the output without.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from bench.checkpoints import CHECKPOINTS, checkpoint
from sluice.app.builtin_models import BUILTIN_PREFIX, ensure_builtin
from sluice.engine.block_manager import BlockManager
from sluice.engine.loader import load_model
from sluice.engine.model_runner import ModelRunner
from sluice.engine.prediction import Prediction
from sluice.engine.scheduler import Scheduler
from sluice.engine.sequence import Sequence
from sluice.engine.worker import keep_heap_memory
from sluice.ipc.messages import SamplingParams


def decode(runner: ModelRunner, prompts: list[list[int]], new_tokens: int, draft_tokens: int,
           predictions: list[list[int]] | None) -> tuple[float, list[list[int]], int, int]:
    """(decode tokens/s after the prompts' step, each output, draft tokens accepted, rejected)."""
    sched = Scheduler(BlockManager(2048, 16), max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096,
                      max_draft_tokens=draft_tokens)
    seqs = [Sequence(f"r{i}", p, SamplingParams(max_tokens=new_tokens, temperature=0.0), seed=i)
            for i, p in enumerate(prompts)]
    for i, s in enumerate(seqs):
        if predictions is not None:
            s.prediction = Prediction(predictions[i])
        sched.add(s)
    outputs: dict[str, list[int]] = {s.request_id: [] for s in seqs}
    first = True
    t0 = 0.0
    while (b := sched.schedule()) is not None:
        samples = runner.run(b)
        for s, tok in sched.update(b, samples.tokens, samples.counts).new_tokens:
            outputs[s.request_id].append(tok)
        if first:  # the prompts' step (with each first token): not decode
            first, t0 = False, time.perf_counter()
    elapsed = time.perf_counter() - t0
    made = sum(map(len, outputs.values())) - len(seqs)
    accepted = sum(s.prediction.accepted for s in seqs if s.prediction is not None)
    rejected = sum(s.prediction.rejected for s in seqs if s.prediction is not None)
    return made / elapsed, [outputs[s.request_id] for s in seqs], accepted, rejected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-chat",
                        help=f"a path, builtin:NAME, or one of {', '.join(CHECKPOINTS)}")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--draft-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    keep_heap_memory()  # as the engine process does
    if args.model.startswith(BUILTIN_PREFIX):
        path = ensure_builtin(args.model.removeprefix(BUILTIN_PREFIX))
    else:
        path = Path(args.model) if Path(args.model).is_dir() else checkpoint(args.model)
    model = load_model(path, dtype, torch.device("cpu"))
    runner = ModelRunner(model, 2048, 16, dtype, torch.device("cpu"))
    rng = np.random.default_rng(0)
    vocab = min(199_000, model.config.vocab_size)
    print(f"{path.name}, {args.dtype}, {torch.get_num_threads()} threads, {args.new_tokens} greedy tokens after "
          f"{args.prompt_len}-token prompts, drafts of up to {args.draft_tokens}")
    print(f"{'batch':>5} {'none tok/s':>11} {'own output':>11} {'x':>6} {'accepted':>9} {'random':>10} {'x':>6}")
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(batch)]
        decode(runner, prompts, 4, args.draft_tokens, None)  # warm-up
        rounds = []
        for _ in range(args.rounds):
            none, outputs, _, _ = decode(runner, prompts, args.new_tokens, args.draft_tokens, None)
            own, same, accepted, rejected = decode(runner, prompts, args.new_tokens, args.draft_tokens, outputs)
            assert same == outputs, "a prediction changed the output"
            wrong = [rng.integers(0, vocab, args.new_tokens).tolist() for _ in range(batch)]
            other, same, _, _ = decode(runner, prompts, args.new_tokens, args.draft_tokens, wrong)
            assert same == outputs, "a prediction changed the output"
            rounds.append((none, own, other, accepted / max(1, accepted + rejected)))
        none, own, other, share = sorted(rounds, key=lambda r: r[1] / r[0])[len(rounds) // 2]
        print(f"{batch:>5} {none:>11.0f} {own:>11.0f} {own / none:>6.2f} {share:>9.0%} {other:>10.0f} "
              f"{other / none:>6.2f}")


if __name__ == "__main__":
    main()
