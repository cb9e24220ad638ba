"""A whole prompt's prefill step in float32 (the backbone: every layer, op by op) with prompts' attention on
csrc/causal_attention.c against the same step on torch's attention, alternated call by call in one process, at
each thread count; and with --profile, the torch ops the kernel's step still runs, by self time. With
--decode, decode steps at temperature 1 (runner.run: the backbone, the LM head and sampling; 130-token prompts)
with the sampler's exp pass on csrc/exp_blocks.c against torch's softmax, each step run both ways.

    SLUICE_CPU_HIDE=avx512f,... python -m bench.prefill_ab [--model llama-135m] [--tokens 2000] [--threads 1,2]
                                                            [--calls 7] [--profile] [--decode 1,16,64]

SLUICE_CPU_HIDE naming every avx512* flag runs the AVX2 builds on an AVX-512 host (a proxy for an AVX2 CPU:
the same instructions, not the same cores or caches). A figure is the median over --calls rounds (two more
first, dropped) of the backbone's milliseconds.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

from bench.checkpoints import CHECKPOINTS, checkpoint
from bench.step_parts import _engine, _prompt
from sluice.engine.cpu import kernels
from sluice.engine.cpu.build import cpu_flags
from sluice.engine.loader import load_model
from sluice.engine.sequence import Sequence
from sluice.ipc.messages import SamplingParams


def _prefill(model, tokens: int):
    """The backbone and the inputs of one step carrying a whole `tokens`-token prompt."""
    runner, sched, rng = _engine(model, torch.float32)
    sched.add(Sequence("p", _prompt(rng, model, tokens), SamplingParams(max_tokens=1), seed=0))
    step = sched.schedule()
    assert step is not None and step.num_new_tokens == [tokens], "the prompt does not fit one step"
    inputs = runner._prepare(step)
    backbone = model.model
    return lambda: backbone(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, inputs.logits_index)


def alternate(run, calls: int) -> dict[str, float]:
    """The step's median ms with the causal kernel and with torch's attention, called in turn."""
    ways = {"torch attention": mock.patch.object(kernels, "causal_attention_f32", return_value=None),
            "causal kernel": mock.patch.object(kernels, "causal_attention_f32", wraps=kernels.causal_attention_f32)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    with torch.inference_mode():
        for r in range(calls + 2):
            for name, way in ways.items():
                with way:
                    t0 = time.perf_counter()
                    run()
                    if r >= 2:
                        times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ms) for name, ms in times.items()}


def decode(model, batch: int, calls: int) -> dict[str, float]:
    """A decode step's median ms with the exp kernel and with torch's softmax (each step run both ways; the
    kernel's tokens taken)."""
    runner, sched, rng = _engine(model, torch.float32)
    for i in range(batch):
        sched.add(Sequence(f"r{i}", _prompt(rng, model, 130), SamplingParams(max_tokens=1000, temperature=1.0),
                           seed=i))
    kernel = runner.exp_kernels
    assert kernel is not None, "no exp kernel on this CPU"
    times: dict[str, list[float]] = {"torch softmax": [], "exp kernel": []}
    for r in range(calls + 4):
        step = sched.schedule()
        assert step is not None
        for name, exp in (("torch softmax", None), ("exp kernel", kernel)):
            runner.exp_kernels = exp
            t0 = time.perf_counter()
            tokens = runner.run(step).tokens
            if r >= 4:  # (the prefill, and warm-up)
                times[name].append((time.perf_counter() - t0) * 1e3)
        sched.update(step, tokens)
    return {name: statistics.median(ms) for name, ms in times.items()}


def profile(run) -> None:
    """The torch ops of one step (the kernel's), by self time."""
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-135m", help=f"a path, or one of {', '.join(CHECKPOINTS)}")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--calls", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--decode", help="instead: decode steps of these batch sizes (comma-separated)")
    args = parser.parse_args()
    path = Path(args.model) if Path(args.model).is_dir() else checkpoint(args.model)
    model = load_model(path, torch.float32, torch.device("cpu"))
    lib = kernels.causal_library()
    wide = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")))
    print(f"causal_attention.c: {lib._name if lib else 'none'}; AVX-512/AMX flags seen: {' '.join(wide) or 'none'}")
    if args.decode:
        print(f"{'threads':>7} {'batch':>5} {'torch softmax ms':>16} {'exp kernel ms':>13} {'speed-up':>8}")
        for n in (int(x) for x in args.threads.split(",")):
            torch.set_num_threads(n)
            for b in (int(x) for x in args.decode.split(",")):
                ms = decode(model, b, args.calls)
                print(f"{n:>7} {b:>5} {ms['torch softmax']:>16.2f} {ms['exp kernel']:>13.2f} "
                      f"{ms['torch softmax'] / ms['exp kernel']:>8.2f}", flush=True)
        return
    run = _prefill(model, args.tokens)
    print(f"{'threads':>7} {'torch attention ms':>18} {'causal kernel ms':>16} {'speed-up':>8}")
    for n in (int(x) for x in args.threads.split(",")):
        torch.set_num_threads(n)
        ms = alternate(run, args.calls)
        print(f"{n:>7} {ms['torch attention']:>18.1f} {ms['causal kernel']:>16.1f} "
              f"{ms['torch attention'] / ms['causal kernel']:>8.2f}", flush=True)
    if args.profile:
        profile(run)


if __name__ == "__main__":
    main()
