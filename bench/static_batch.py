"""Sluice's engine against transformers `generate` on the same checkpoint and batch, and each
decode step against its memory-bandwidth floor (reading the LM head once).

    python -m bench.static_batch [--batches 1,8,32] [--new-tokens 64] [--prompt-len 32] [--dtype float32]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench.checkpoints import tiny_llama_o200k
from engine.block_manager import BlockManager
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.worker import keep_heap_memory
from ipc.messages import SamplingParams


def bandwidth_gbps(nbytes: int = 256 << 20) -> tuple[float, float]:
    """(memcpy: bytes copied per second, read: bytes summed per second) over 256 MB, past the caches, in
    GB/s. A copy moves each byte twice (or three times, with the write's cache fill), so the read figure
    is the harder floor for a step that reads its LM head once."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)

    def rate(fn) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        return 5 * nbytes / (time.perf_counter() - t0) / 1e9

    return rate(lambda: dst.copy_(src)), rate(src.sum)


def sluice_decode(model, batch: int, prompt_len: int, new_tokens: int, dtype) -> tuple[float, float]:
    """(decode tokens/s, mean decode step ms) through the scheduler and paged runner."""
    runner = ModelRunner(model, 4096, 16, dtype, torch.device("cpu"))
    sched = Scheduler(BlockManager(4096, 16), max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096)
    rng = np.random.default_rng(0)
    for i in range(batch):
        sched.add(Sequence(f"r{i}", rng.integers(0, 199_000, prompt_len).tolist(),
                           SamplingParams(max_tokens=new_tokens, temperature=0.0), seed=i))
    steps = []
    while (b := sched.schedule()) is not None:
        t0 = time.perf_counter()
        sched.update(b, runner.run(b).tokens)
        steps.append(time.perf_counter() - t0)
    decode = steps[1:]  # the first step is the prefill
    return batch * len(decode) / sum(decode), 1000 * float(np.mean(decode))


def hf_generate(path, batch: int, prompt_len: int, new_tokens: int, dtype) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ids = torch.randint(0, 199_000, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        total = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)  # its prefill alone
        prefill = time.perf_counter() - t0
    return batch * (new_tokens - 1) / (total - prefill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    keep_heap_memory()  # as the engine process does
    path = tiny_llama_o200k()
    model = load_model(path, dtype, torch.device("cpu"))
    head = model.lm_head.weight
    copy_gbps, read_gbps = bandwidth_gbps()
    nbytes = head.numel() * head.element_size()
    floor_ms, read_floor_ms = nbytes / (copy_gbps * 1e9) * 1000, nbytes / (read_gbps * 1e9) * 1000
    print(f"LM head {nbytes / 1e6:.0f} MB; a step's memory-bandwidth floor: {floor_ms:.2f} ms at memcpy's "
          f"{copy_gbps:.1f} GB/s, {read_floor_ms:.2f} ms at a read's {read_gbps:.1f} GB/s "
          f"({args.dtype}, {torch.get_num_threads()} threads)")
    print(f"{'batch':>5} {'sluice tok/s':>13} {'step ms':>8} {'x floor':>8} {'x read floor':>13} "
          f"{'transformers tok/s':>19} {'ratio':>6}")
    for batch in (int(b) for b in args.batches.split(",")):
        sluice_decode(model, batch, args.prompt_len, 4, dtype)  # warm-up
        tps, step = sluice_decode(model, batch, args.prompt_len, args.new_tokens, dtype)
        ref = hf_generate(path, batch, args.prompt_len, args.new_tokens, dtype)
        print(f"{batch:>5} {tps:>13.0f} {step:>8.2f} {step / floor_ms:>8.2f} {step / read_floor_ms:>13.2f} "
              f"{ref:>19.0f} {tps / ref:>6.2f}")


if __name__ == "__main__":
    main()
