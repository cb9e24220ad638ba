"""A GGUF file with Q5_0 / Q5_1 tensors (llama-quantize's Q4_K_M / Q5_K_M of a model whose rows are 576 long:
SmolLM2-135M/360M) served with them repacked to Q8_0 at load (engine/gguf.py) against the same file with them
dequantized to float32 (the path before the repack), in one process: the weights' memory and the decode step's
time, the two engines' steps interleaved (A/B on a loaded machine: only the ratio means anything).

    python -m bench.gguf_q5 FILE.gguf [--seqs 8] [--steps 40]

A Q4_K_M file of the trained SmolLM2-135M: `llama-quantize SmolLM2-135M-Instruct.Q4_1.F32.gguf OUT Q4_K_M`
(bench/perplexity.py makes the F32 file).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sluice.base.gguf_checkpoint import gguf_checkpoint
from sluice.engine import gguf
from sluice.engine.block_manager import BlockManager
from sluice.engine.loader import load_model
from sluice.engine.model_runner import ModelRunner
from sluice.engine.scheduler import Scheduler
from sluice.engine.sequence import Sequence
from sluice.ipc.messages import SamplingParams


def engine(meta: Path, repack: bool, seqs: int):
    """(runner, scheduler, the weights' bytes) of the file, its Q5 tensors repacked or dequantized, `seqs`
    sequences prefilled."""
    kept = dict(gguf._REPACKED)
    if not repack:
        gguf._REPACKED.clear()
    try:
        model = load_model(meta, torch.float32, torch.device("cpu"))
    finally:
        gguf._REPACKED.update(kept)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    nbytes += sum(q.nbytes for m in model.modules() for q in (getattr(m, "quant", None) or ()))
    runner = ModelRunner(model, 256, 16, torch.float32, torch.device("cpu"), 256)
    sched = Scheduler(BlockManager(256, 16, True), max_num_seqs=64, max_num_batched_tokens=2048,
                      max_model_len=4096, sliding_window=runner.sliding_window)
    for i in range(seqs):
        sched.add(Sequence(f"r{i}", list(range(10 + i, 40 + i)), SamplingParams(max_tokens=10_000, temperature=0.0),
                           seed=0))
    step(runner, sched)
    return runner, sched, nbytes


def step(runner, sched) -> float:
    start = time.perf_counter()
    batch = sched.schedule()
    logits, _ = runner.forward(batch)
    sched.update(batch, logits.argmax(-1).tolist())
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    meta = gguf_checkpoint(args.file, Path(tempfile.mkdtemp(prefix="gguf-q5-")))
    engines = {"Q8_0 (repacked)": engine(meta, True, args.seqs),
               "float32 (dequantized)": engine(meta, False, args.seqs)}
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(args.steps):
        for name, (runner, sched, _) in engines.items():
            times[name].append(step(runner, sched))
    for name, (_, _, nbytes) in engines.items():
        print(f"{name:24} weights {nbytes / 2**20:7.1f} MiB  decode step (batch {args.seqs}) median "
              f"{statistics.median(times[name]) * 1e3:7.2f} ms")
    a, b = (statistics.median(t) for t in times.values())
    print(f"float32 / Q8_0 step time: {b / a:.3f}")


if __name__ == "__main__":
    main()
