"""The float32 path's last torch ops on AVX2 against their kernels, alternated call by call in one process, so
that the machine's drift falls on both alike:

- a whole prompt's prefill step (the backbone, op by op) with its SwiGLU on csrc/f32_layers.c and the residual
  adds in place, against torch's SwiGLU and a new tensor per add (the path before);
- the LM head alone (3 x --calls rounds), then greedy decode steps (runner.run: the backbone, the LM head's
  argmax), with the LM head's rows screened in int8 (csrc/f32_int8_argmax.c) against the float32 kernel's argmax;
  with --base, this build's screen against another build's (a .so: the AVX-512 build before and after a change
  to the screen's source).

    SLUICE_CPU_HIDE=avx512f,... python -m bench.avx2_float [--model llama-135m] [--tokens 2000]
                                                           [--batches 1,16,64] [--calls 7] [--base old.so]

SLUICE_CPU_HIDE naming every avx512* flag runs the AVX2 builds on an AVX-512 host (a proxy for an AVX2 CPU: the
same instructions, not the same cores or caches). A figure is the median over --calls rounds (two more first,
dropped) of the process's CPU time (every thread's) and of wall time, in ms; on a loaded machine the CPU time's
ratio is the steadier one.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path
from typing import Callable
from unittest import mock

import torch

from bench.checkpoints import CHECKPOINTS, checkpoint
from bench.prefill_ab import _prefill
from bench.step_parts import _engine, _prompt
from sluice.engine.cpu import kernels
from sluice.engine.cpu.build import cpu_flags
from sluice.engine.cpu.lm_head import CpuLMHead
from sluice.engine.layers import DecoderLayer
from sluice.engine.loader import load_model
from sluice.engine.sequence import Sequence
from sluice.ipc.messages import SamplingParams


def _added(layer, x, positions, kv, meta):
    """DecoderLayer.forward as it was: a new tensor per residual add."""
    x = x + layer.self_attn(layer.input_layernorm(x), positions, kv, meta)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _once(run: Callable[[], object]) -> tuple[float, float]:
    """(CPU ms, wall ms) of one call."""
    c0, t0 = time.process_time(), time.perf_counter()
    run()
    return (time.process_time() - c0) * 1e3, (time.perf_counter() - t0) * 1e3


def _medians(times: dict[str, list[tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    """Each way's median (CPU ms, wall ms) past its first two calls."""
    return {name: (statistics.median(c for c, _ in t[2:]), statistics.median(w for _, w in t[2:]))
            for name, t in times.items()}


def prefill(model, tokens: int, calls: int) -> dict[str, tuple[float, float]]:
    run = _prefill(model, tokens)

    def before():
        with mock.patch.object(kernels, "f32_swiglu", return_value=None), \
                mock.patch.object(DecoderLayer, "forward", _added):
            run()

    times: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    with torch.inference_mode():
        for _ in range(calls + 2):
            for name, fn in (("before", before), ("after", run)):
                times[name].append(_once(fn))
    return _medians(times)


def decode(model, batch: int, calls: int, base) -> dict[str, tuple[float, float]]:
    """Greedy decode steps of `batch` rows (130-token prompts), each step run both ways (the screen's tokens
    taken)."""
    runner, sched, rng = _engine(model, torch.float32)
    lm = runner.lm_head
    assert isinstance(lm, CpuLMHead) and lm.screen is not None, "the LM head is not screened on this CPU"
    screen = lm.screen
    for i in range(batch):
        sched.add(Sequence(f"r{i}", _prompt(rng, model, 130), SamplingParams(max_tokens=1000, temperature=0.0),
                           seed=i))
    while (step := sched.schedule()) is not None and max(step.num_new_tokens) > 1:
        sched.update(step, runner.run(step).tokens)  # (the prompts)
    assert step is not None
    out: dict[str, list] = {}

    def way(name: str, fn) -> Callable[[], object]:
        def run():
            lm.screen, screen.fn = (screen, fn) if fn else (None, screen.fn)
            out[name] = runner.run(step).tokens
        return run

    mine = screen.fn
    ways = {"before": way("before", base), "after": way("after", mine)}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    with torch.inference_mode():
        for _ in range(calls + 2):
            for name, run in ways.items():
                times[name].append(_once(run))
            assert out["before"] == out["after"], "the screen's tokens differ"
            sched.update(step, out["after"])
            step = sched.schedule()
            assert step is not None
    lm.screen, screen.fn = screen, mine
    return _medians(times)


def head(model, batch: int, calls: int, base) -> dict[str, tuple[float, float]]:
    """The LM head alone on `batch` rows (the model's final norm of random hidden states): its screen against the
    float32 kernel's argmax (or the base build's screen), the same tokens."""
    runner, _, _ = _engine(model, torch.float32)
    lm, g = runner.lm_head, torch.Generator().manual_seed(batch)
    assert isinstance(lm, CpuLMHead) and lm.screen is not None, "the LM head is not screened on this CPU"
    screen, kernel = lm.screen, lm.kernel
    assert kernel is not None
    hidden = model.model.norm(torch.randn(batch, model.config.hidden_size, generator=g))
    mine = screen.fn

    def screened(fn):
        def run():
            screen.fn = fn
            return screen(hidden)
        return run

    ways = {"before": screened(base) if base else (lambda: kernel.argmax(hidden)), "after": screened(mine)}
    assert torch.equal(ways["before"](), ways["after"]())
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    with torch.inference_mode():
        for _ in range(calls + 2):
            for name, run in ways.items():
                times[name].append(_once(run))
    screen.fn = mine
    return _medians(times)


def _base(path: str):
    fn = ctypes.CDLL(path).sluice_f32_int8_argmax
    fn.restype, fn.argtypes = ctypes.c_int, kernels.f32_int8_argmax().argtypes
    return fn


def _row(what: str, ms: dict[str, tuple[float, float]]) -> str:
    (bc, bw), (ac, aw) = ms["before"], ms["after"]
    return f"{what:>16} {bc:>10.1f} {ac:>10.1f} {bc / ac:>9.3f} {bw:>10.1f} {aw:>10.1f} {bw / aw:>9.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-135m", help=f"a path, or one of {', '.join(CHECKPOINTS)}")
    parser.add_argument("--tokens", type=int, default=2000, help="the prompt's tokens (0: no prefill)")
    parser.add_argument("--batches", default="1,16,64", help="decode batch sizes ('': none)")
    parser.add_argument("--calls", type=int, default=7)
    parser.add_argument("--base", help="another build of csrc/f32_int8_argmax.c (a .so): 'before' in decode")
    args = parser.parse_args()
    path = Path(args.model) if Path(args.model).is_dir() else checkpoint(args.model)
    model = load_model(path, torch.float32, torch.device("cpu"))
    wide = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")))
    screen = kernels.f32_int8_library()
    print(f"threads {torch.get_num_threads()}; AVX-512/AMX flags seen: {' '.join(wide) or 'none'}; "
          f"screen: {screen._name if screen else 'none'}")
    print(f"{'':>16} {'before cpu':>10} {'after cpu':>10} {'cpu ratio':>9} {'before ms':>10} {'after ms':>10} "
          f"{'ms ratio':>9}")
    if args.tokens:
        print(_row(f"prefill {args.tokens}", prefill(model, args.tokens, args.calls)), flush=True)
    base = _base(args.base) if args.base else None
    for b in (int(x) for x in args.batches.split(",") if x):
        print(_row(f"LM head {b}", head(model, b, 3 * args.calls, base)), flush=True)
    for b in (int(x) for x in args.batches.split(",") if x):
        print(_row(f"decode {b}", decode(model, b, args.calls, base)), flush=True)


if __name__ == "__main__":
    main()
