"""A float32 decode step's layers op by op (the backend's kernels between torch ops) against the same step in
one call (csrc/f32_layers.c, on the instruction sets this CPU runs: SLUICE_CPU_HIDE picks the AVX2 build on an
AVX-512 host), alternated call by call in one process, so that the machine's drift falls on both alike.

    SLUICE_CPU_HIDE=avx512f,... python -m bench.one_call [--model llama-135m] [--batches 1,16,64] [--calls 15]
    python -m bench.one_call --base /path/to/f32_layers.so   # the one call: this build against another's

Each sequence has a 130-token prompt and 10 decoded tokens (each decode attends to ~140 keys). A figure is the
median over --calls rounds of the backbone's milliseconds (the LM head and sampling are not in it).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import torch

from bench.checkpoints import CHECKPOINTS, checkpoint
from bench.step_parts import _engine, _prompt
from sluice.engine.cpu import kernels
from sluice.engine.cpu.build import cpu_flags
from sluice.engine.cpu.stack import F32LayerSpec, StepSpec
from sluice.engine.loader import load_model
from sluice.engine.sequence import Sequence
from sluice.ipc.messages import SamplingParams


def _base(path: str):
    lib = ctypes.CDLL(path)
    fn = lib.sluice_f32_layers
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(F32LayerSpec), ctypes.c_int, ctypes.POINTER(StepSpec), ctypes.c_void_p]
    return fn


def alternate(model, batch: int, calls: int, base) -> dict[str, float]:
    """The backbone's median ms for one decode step of `batch` rows: op by op and in one call (or this build's
    one call and the base's)."""
    runner, sched, rng = _engine(model, torch.float32)
    for i in range(batch):
        sched.add(Sequence(f"r{i}", _prompt(rng, model, 130), SamplingParams(max_tokens=1000), seed=i))
    for _ in range(10):
        b = sched.schedule()
        assert b is not None
        sched.update(b, runner.run(b).tokens)
    step = sched.schedule()
    assert step is not None
    inputs = runner._prepare(step)
    backbone = model.model
    one_call = backbone.stack
    assert one_call is not None, "the step does not run in one call on this CPU"
    this = one_call.stack.fn

    def op_by_op():
        backbone.stack = None

    def in_one_call():
        backbone.stack, one_call.stack.fn = one_call, this

    def on_base():
        backbone.stack, one_call.stack.fn = one_call, base

    ways = {"one call": in_one_call, "base": on_base} if base else {"op by op": op_by_op, "one call": in_one_call}
    times: dict[str, list[float]] = {name: [] for name in ways}
    with torch.inference_mode():
        for r in range(calls + 2):
            for name, choose in ways.items():
                choose()
                t0 = time.perf_counter()
                backbone(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, inputs.logits_index)
                if r >= 2:  # (warm-up)
                    times[name].append((time.perf_counter() - t0) * 1e3)
    in_one_call()
    return {name: statistics.median(ms) for name, ms in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-135m", help=f"a path, or one of {', '.join(CHECKPOINTS)}")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--base", help="another build of csrc/f32_layers.c (a .so) to time the one call against")
    args = parser.parse_args()
    path = Path(args.model) if Path(args.model).is_dir() else checkpoint(args.model)
    model = load_model(path, torch.float32, torch.device("cpu"))
    isa = "AVX-512F" if kernels.f32_layers() is not None else "AVX2" if kernels.f32_layers_avx2() else "none"
    wide = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")))
    print(f"f32_layers.c build: {isa}; AVX-512/AMX flags seen: {' '.join(wide) or 'none'}")
    base = _base(args.base) if args.base else None
    names = ["one call", "base"] if base else ["op by op", "one call"]
    ratio = "this/base" if base else "speed-up"
    print(f"{'batch':>5} " + " ".join(f"{n + ' ms':>12}" for n in names) + f" {ratio:>9}")
    for b in (int(x) for x in args.batches.split(",")):
        ms = alternate(model, b, args.calls, base)
        print(f"{b:>5} " + " ".join(f"{ms[n]:>12.2f}" for n in names) + f" {ms[names[0]] / ms[names[1]]:>9.2f}")


if __name__ == "__main__":
    main()
