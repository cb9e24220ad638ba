"""A decode step's attention over the paged KV cache, for each --kv-cache-dtype, in process.

    python -m bench.kv_attention [--dtypes float32,float16,int8,fp8] [--seqs 64] [--keys 200] [--layers 30]
        [--heads 9/3x64] [--steps 5] [--repeat 2] [--activations bfloat16]

One decode row a sequence, each sequence's keys in slots of its own as the block manager hands them out
(contiguous within a sequence, one region a layer), every layer's cache its own: what a step of a model of
--layers layers reads, through the kernel the step runs (`ops.decode_attention`, csrc/f32_layers.c's float32
attention of this CPU's best build). Each dtype's caches are filled through `attention.store_rows` (the bytes
the engine stores). Prints ms a step (the mean of --steps after one untimed), the cache bytes a step reads and
the rate; --repeat runs the dtypes again in turn (this machine's speed drifts within minutes). With --layers 1
and few sequences the cache stays in the L3: the kernel's arithmetic alone. `--activations bfloat16`: bf16
queries over a bf16 cache, csrc/decode_attention.c (AVX512-BF16), the kernel of a `--dtype bfloat16` step.
"""
from __future__ import annotations

import argparse
import time

import torch

from sluice.engine.attention import cache_row, store_rows
from sluice.engine.cpu import ops
from sluice.engine.engine import pick_kv_dtype


def layer_slots(seqs: int, keys: int, layers: int) -> list[torch.Tensor]:
    """Each layer's [seqs, keys] slots: layer i's sequence s holds slots (i * seqs + s) * keys onwards."""
    return [((i * seqs + torch.arange(seqs))[:, None] * keys + torch.arange(keys)).contiguous() for i in range(layers)]


def kv_caches(kv: torch.dtype, slots: int, kv_heads: int, dim: int, g: torch.Generator) -> list[torch.Tensor]:
    """A key and a value cache of `slots` slots of dtype kv, filled with random rows as the engine stores them."""
    caches = []
    for _ in range(2):
        cache = torch.zeros(slots, kv_heads, cache_row(kv, dim), dtype=kv)
        store_rows(cache, torch.arange(slots), torch.randn(slots, kv_heads, dim, generator=g))
        caches.append(cache)
    return caches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float32,float16,int8,fp8", help="--kv-cache-dtype values")
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--keys", type=int, default=200, help="keys a sequence")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", default="9/3x64", help="query heads / kv heads x head dim (SmolLM2-135M's)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--activations", default="float32", choices=["float32", "bfloat16"])
    a = p.parse_args()
    heads_kv, dim = a.heads.split("x")
    heads, kv_heads, dim = *map(int, heads_kv.split("/")), int(dim)
    b, k, layers = a.seqs, a.keys, a.layers
    slots = b * k * layers
    g = torch.Generator().manual_seed(0)
    act = getattr(torch, a.activations)
    q, rows = torch.randn(b, heads, dim, generator=g).to(act), torch.arange(b)
    out = torch.zeros(b, heads, dim, dtype=act)
    mask = torch.ones(b, 1, 1, k, dtype=torch.bool)
    slots_of = layer_slots(b, k, layers)
    print(f"{b} sequences of {k} keys, {layers} layers, {heads}/{kv_heads} heads of {dim}", flush=True)
    for _ in range(a.repeat):
        for name in a.dtypes.split(","):
            kv = pick_kv_dtype(name, act, None)
            caches = kv_caches(kv, slots, kv_heads, dim, g)

            def step() -> None:
                for s in slots_of:
                    assert ops.decode_attention(q, caches[0], caches[1], rows, s, mask, dim ** -0.5, None, out), \
                        f"the kernel does not take a {name} cache here"

            step()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step()
            ms = (time.perf_counter() - t0) / a.steps * 1e3
            mb = 2 * b * k * layers * kv_heads * cache_row(kv, dim) * kv.itemsize / 1e6
            print(f"  {name:9} {ms:7.2f} ms a step  {mb:6.0f} MB read  {mb / ms:5.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
