"""This tree's CPU kernels against another tree's build of them, in one process, call by call.

    git archive <commit> | tar -x -C /tmp/atHEAD      # the tree to compare with (once)
    python -m bench.kernel_ab --base /tmp/atHEAD [--linears 4096x1024,576x1536] [--rows 1,16,2080]
        [--causal 9/3x64,16/8x128] [--tokens 2000] [--calls 11]
    python -m bench.kernel_ab --amx [--linears ...] [--rows ...]   # this tree's AVX-512F products against AMX's
    python -m bench.kernel_ab --avx2 --base /tmp/atHEAD [...]     # both trees' AVX2 builds (on any AVX2 CPU)
    python -m bench.kernel_ab --base /tmp/atHEAD --quant Q8_C,Q8_0 [--linears ...] [--rows ...] [--avx2]
    python -m bench.kernel_ab --amx --base /tmp/atHEAD [...]      # the other tree's AMX products against these
    python -m bench.kernel_ab --base /tmp/atHEAD --linears '' --causal '' --decode 9/3x64,16/8x128
        [--kv-dtypes float32,float16,int8] [--seqs 64] [--keys 200] [--layers 30] [--avx2]

These machines' speed drifts by tens of percent within minutes, so two runs minutes apart cannot tell a 5% change in
a kernel. Here both builds of a library (csrc/f32_layers.c's float32 products with bf16 weights;
csrc/causal_attention.c's prompts' attention) are loaded into one process and called in turn on the same inputs:
each figure is the median of --calls calls (the first two dropped), with the ratio this / base and whether the two
outputs are bit-equal (the products must be: each output is one FMA chain over k in order; SwiGLU: the stacked
weight's silu(gate half) * up half, where N is whole groups of 128; --decode: a decode step's attention over the
paged cache, f32_layers.c's, a call a layer, the caches past the L3 as a step's are). With --amx, "base" is this
tree's AVX-512F products and "this" its AMX ones, in the same library (their outputs differ by the order of the
sums: the difference is printed); with --base too, the other tree's AMX products against these. With --quant,
csrc/quant_matmul.c's products with int8 activations (the same repacked weight through each tree's library;
bit-equal too: a row's int32 sums and their float order do not depend on its batch). --avx2: both trees' AVX2 builds, on
any CPU that runs them.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from sluice.engine.cpu import kernels
from sluice.engine.cpu.build import cpu_flags
from sluice.engine.cpu.matmul import F32Matmul
from sluice.engine.cpu.quant import QUANT_LINEAR

# each library's instruction sets, as engine/cpu/kernels.py loads it
LIBRARIES = {"f32_layers": "_AVX512_VL", "causal_attention": "_AVX512"}


def built(tree: Path, *names: str, isa: str | None = None) -> list[ctypes.CDLL]:
    """`tree`'s builds of the kernel libraries `names` (for the instruction sets sluice.engine.cpu.kernels names
    `isa`, by default as it loads each; built into the kernel cache if they are not there yet), in one process."""
    code = ("from sluice.engine.cpu.build import load; from sluice.engine.cpu import kernels as k\n"
            + "".join(f"lib = load({name!r}, k.{isa or LIBRARIES[name]}); print(lib._name if lib else '-')\n"
                      for name in names))
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                         capture_output=True, text=True, check=True).stdout.split()[-len(names):]
    libs = []
    for name, path in zip(names, out):
        if path == "-":
            raise SystemExit(f"{tree}: the kernel library {name} did not build on this CPU")
        lib = ctypes.CDLL(path)
        for symbol, argtypes in (("sluice_f32_matmul", kernels._LINEAR_F32),
                                 ("sluice_f32_matmul_swiglu", kernels._LINEAR_F32[:-1]),
                                 ("sluice_f32_causal_attention", kernels._CAUSAL_F32),
                                 ("sluice_f32_decode_attention", kernels._DECODE_F32),
                                 ("sluice_quant_linear", QUANT_LINEAR)):
            if hasattr(lib, symbol):
                fn = getattr(lib, symbol)
                fn.restype, fn.argtypes = ctypes.c_int, argtypes
        libs.append(lib)
    return libs


def alternate(calls: int, *fns) -> list[float]:
    """Each function's median milliseconds over `calls` rounds, the functions called in turn each round."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(calls):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t[2:]) * 1000 for t in times]


def report(what: str, ms: list[float], outs: list[torch.Tensor]) -> None:
    same = "bit-equal" if torch.equal(*outs) else f"max |difference| {(outs[0] - outs[1]).abs().max():.1e}"
    print(f"{what:34} base {ms[0]:9.4f} ms  this {ms[1]:9.4f} ms  this/base {ms[1] / ms[0]:.3f}  {same}", flush=True)


def linears(base: ctypes.CDLL, this: ctypes.CDLL, shapes: list[str], rows: list[int], calls: int,
            amx: bool = False) -> None:
    """Each shape's products, base against this (amx: one library, AVX-512F against AMX)."""
    g = torch.Generator().manual_seed(0)
    for shape in shapes:
        n, k = map(int, shape.split("x"))
        weight = torch.randn(n, k, generator=g).bfloat16()
        pair = [F32Matmul(lib, "AVX-512F", weight, None, amx=amx and (i == 1 or base is not this))
                for i, lib in enumerate((base, this))]
        for m in rows:
            x = torch.randn(m, k, generator=g)
            kinds = [("linear", lambda f: f)] + ([("SwiGLU", lambda f: f.swiglu)] if pair[0].swiglu_ok else [])
            for kind, pick in kinds:
                outs = [None, None]

                def call(i: int):
                    def run() -> None:
                        outs[i] = pick(pair[i])(x)
                    return run

                ms = alternate(calls, call(0), call(1))
                report(f"{kind} {shape}, {m} rows", ms, outs)


def causal(base: ctypes.CDLL, this: ctypes.CDLL, shapes: list[str], tokens: int, calls: int) -> None:
    g = torch.Generator().manual_seed(0)
    for shape in shapes:
        heads_text, rest = shape.split("/")
        kv_heads, dim = map(int, rest.split("x"))
        heads = int(heads_text)
        q = torch.randn(1, tokens, heads, dim, generator=g)
        k, v = (torch.randn(1, tokens, kv_heads, dim, generator=g) for _ in range(2))
        outs = [torch.empty_like(q) for _ in range(2)]

        def call(i: int, lib: ctypes.CDLL):
            def run() -> None:
                rc = lib.sluice_f32_causal_attention(q.data_ptr(), None, k.data_ptr(), v.data_ptr(), None, None, 1,
                                                     tokens, tokens, heads, kv_heads, dim, dim**-0.5,
                                                     outs[i].data_ptr(), None, -1, 0)  # (float32 k, v)
                assert rc == 0, rc
            return run

        ms = alternate(calls, call(0, base), call(1, this))
        report(f"causal {shape}, {tokens} tokens", ms, outs)


def decode(base: ctypes.CDLL, this: ctypes.CDLL, shapes: list[str], dtypes: list[str], seqs: int, keys: int,
           layers: int, calls: int) -> None:
    """A decode step's attention (one query row a sequence over its keys, every layer in turn), base against
    this, for each shape and --kv-cache-dtype."""
    from bench.kv_attention import kv_caches, layer_slots
    from sluice.engine.cpu.ops import kv_kind
    from sluice.engine.engine import pick_kv_dtype

    g = torch.Generator().manual_seed(0)
    for shape in shapes:
        heads_text, rest = shape.split("/")
        kv_heads, dim = map(int, rest.split("x"))
        heads = int(heads_text)
        q, rows = torch.randn(seqs, heads, dim, generator=g), torch.arange(seqs)
        attend = torch.ones(seqs, keys, dtype=torch.uint8)
        slots_of = layer_slots(seqs, keys, layers)
        for name in dtypes:
            kv = pick_kv_dtype(name, torch.float32, None)
            caches = kv_caches(kv, seqs * keys * layers, kv_heads, dim, g)
            kind = kv_kind(caches[0], caches[1], dim)
            assert kind is not None, f"the float32 kernels do not take a {name} cache"
            outs = [torch.zeros(seqs, heads, dim) for _ in range(2)]

            def call(i: int, lib: ctypes.CDLL):
                def run() -> None:
                    for slots in slots_of:
                        rc = lib.sluice_f32_decode_attention(
                            q.data_ptr(), q.stride(0), caches[0].data_ptr(), caches[1].data_ptr(), rows.data_ptr(),
                            slots.data_ptr(), attend.data_ptr(), None, seqs, heads, kv_heads, dim, keys,
                            dim**-0.5, outs[i].data_ptr(), kind)
                        assert rc == 0, rc
                return run

            report(f"decode {shape} {name}, {seqs}x{keys}x{layers}", alternate(calls, call(0, base), call(1, this)),
                   outs)


def quant(base: ctypes.CDLL, this: ctypes.CDLL, kinds: list[str], shapes: list[str], rows: list[int],
          calls: int) -> None:
    """Each shape's quantized products with int8 activations (csrc/quant_matmul.c; Q8_C: compressed-tensors'
    per-channel int8, else a GGUF block format, repacked as served), base against this."""
    from bench.quant import per_channel
    from sluice.engine.cpu.quant import QuantMatmul
    from sluice.engine.quant import quantize

    g = torch.Generator().manual_seed(0)
    for shape in shapes:
        n, k = map(int, shape.split("x"))
        w = torch.randn(n, k, generator=g) * 0.02
        for kind in kinds:
            weight = per_channel(w) if kind == "Q8_C" else quantize(w, kind)
            pair: list[QuantMatmul] = []
            for lib in (base, this):  # (the same repacked weight through each tree's library: their layouts agree)
                kernel = QuantMatmul.build(weight, None, int8=True)
                assert kernel is not None
                kernel.lib = lib
                pair.append(kernel)
            for m in rows:
                x = torch.randn(m, k, generator=g)
                outs = [None, None]

                def call(i: int):
                    def run() -> None:
                        outs[i] = pair[i](x)
                    return run

                report(f"{kind} {shape}, {m} rows", alternate(calls, call(0), call(1)), outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="the other tree (its engine/csrc)")
    parser.add_argument("--amx", action="store_true", help="instead: AVX-512F's products against AMX's, this tree")
    parser.add_argument("--avx2", action="store_true", help="both trees' AVX2 and FMA builds (on any CPU with them)")
    parser.add_argument("--quant", default="", help="instead: the quantized products (csrc/quant_matmul.c, int8 "
                        "activations) of these kinds, e.g. Q8_C,Q8_0,Q4_0")
    parser.add_argument("--linears", default="4096x1024,1024x2048,6144x1024,1024x3072,960x576,3072x576,576x1536",
                        help="weight shapes N x K ('' for none)")
    parser.add_argument("--rows", default="1,16,64,256,2080")
    parser.add_argument("--causal", default="9/3x64,16/8x128", help="heads / kv heads x head dim ('' for none)")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--decode", default="", help="a decode step's attention: heads / kv heads x head dim")
    parser.add_argument("--kv-dtypes", default="float32,float16,int8", help="--decode's --kv-cache-dtype values")
    parser.add_argument("--seqs", type=int, default=64, help="--decode's sequences")
    parser.add_argument("--keys", type=int, default=200, help="--decode's keys a sequence")
    parser.add_argument("--layers", type=int, default=30, help="--decode's layers a step")
    parser.add_argument("--calls", type=int, default=11)
    args = parser.parse_args()
    print("CPU flags:", " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")))), flush=True)
    if args.amx:
        if not kernels.f32_amx():
            raise SystemExit("AMX's products do not run on this CPU")
        lib = kernels.f32_layers()
        base = lib if args.base is None else built(args.base, "f32_layers", isa="_AMX")[0]
        linears(base, lib, args.linears.split(","), [int(r) for r in args.rows.split(",")], args.calls, amx=True)
        return
    if args.base is None:
        raise SystemExit("--base (or --amx) is required")
    if args.quant:
        quant_isa = "_AVX2" if args.avx2 else "_AVX512_VL_VNNI"
        base_q, this_q = (built(tree, "quant_matmul", isa=quant_isa)[0] for tree in (args.base, Path.cwd()))
        quant(base_q, this_q, args.quant.split(","), args.linears.split(","), [int(r) for r in args.rows.split(",")],
              args.calls)
        return
    names = [name for name, wanted in (("f32_layers", args.linears or args.decode),
                                       ("causal_attention", args.causal)) if wanted]
    isa = "_AVX2" if args.avx2 else None
    base, this = (dict(zip(names, built(tree, *names, isa=isa))) for tree in (args.base, Path.cwd()))
    if args.linears:
        linears(base["f32_layers"], this["f32_layers"], args.linears.split(","),
                [int(r) for r in args.rows.split(",")], args.calls)
    if args.causal:
        causal(base["causal_attention"], this["causal_attention"], args.causal.split(","), args.tokens, args.calls)
    if args.decode:
        decode(base["f32_layers"], this["f32_layers"], args.decode.split(","), args.kv_dtypes.split(","), args.seqs,
               args.keys, args.layers, args.calls)


if __name__ == "__main__":
    main()
