"""Sluice's engine against transformers `generate` on the same checkpoint and batch, and each
decode step against its memory-bandwidth floor: the bytes a step must read (every weight the step's kernels
read, at the width they read it, and the KV cache its rows attend to) at this run's memcpy and read rates.

    python -m bench.static_batch [--model tiny-llama-o200k] [--batches 1,8,32] [--new-tokens 64]
                                 [--prompt-len 32] [--dtype float32] [--no-transformers]
    python -m bench.static_batch --model llama-135m --continuous 64 --batches 16 --prompt-len 100 --new-tokens 128
    python -m bench.static_batch --model llama-135m --prefill-len 2080     # one prompt's prefill, the server's budget
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from bench.checkpoints import CHECKPOINTS, checkpoint
from sluice.base.config import ServerConfig
from sluice.engine.block_manager import BlockManager
from sluice.engine.engine import pick_kv_dtype
from sluice.engine.loader import load_model
from sluice.engine.model_runner import ModelRunner
from sluice.engine.scheduler import Scheduler
from sluice.engine.sequence import Sequence
from sluice.engine.worker import keep_heap_memory
from sluice.ipc.messages import SamplingParams


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


def weight_bytes(runner: ModelRunner) -> int:
    """The bytes of every weight a decode step reads, at the width it reads them: each linear's (its packed
    copy where a kernel runs it), the LM head's and the norms'."""
    total = 0
    for m in runner.model.modules():
        if hasattr(m, "run") and m.quant is not None:  # (a quantized linear: its blocks' bytes)
            total += sum(p.nbytes for p in (m.quant if isinstance(m.quant, tuple) else (m.quant,)))
        elif hasattr(m, "run"):
            w = getattr(m.run, "packed", m.weight)
            total += w.numel() * w.element_size()
        elif type(m).__name__ == "RMSNorm":
            total += m.weight.numel() * m.weight.element_size()
    head = runner.lm_head
    w = getattr(head.kernel, "packed", head.weight)
    return total + w.numel() * w.element_size()


def kv_bytes(model, batch: int, context: int, dtype) -> int:
    """The KV cache (of `dtype`) a decode step of `batch` rows at `context` keys each reads."""
    layers, heads, dim = model.kv_shape
    return 2 * layers * heads * dim * batch * context * torch.empty((), dtype=dtype).element_size()


def _engine(model, dtype) -> tuple[ModelRunner, Scheduler]:
    """The model's runner (its KV cache of the dtype the server's --kv-cache-dtype auto picks) and a scheduler."""
    runner = ModelRunner(model, 2048, 16, dtype, torch.device("cpu"), kv_dtype=pick_kv_dtype("auto", dtype, model))
    return runner, Scheduler(BlockManager(2048, 16), max_num_seqs=256, max_num_batched_tokens=8192,
                             max_model_len=4096)


def sluice_decode(model, batch: int, prompt_len: int, new_tokens: int, dtype) -> tuple[float, float]:
    """(decode tokens/s, mean decode step ms) through the scheduler and paged runner."""
    runner, sched = _engine(model, dtype)
    rng = np.random.default_rng(0)
    for i in range(batch):
        sched.add(Sequence(f"r{i}", rng.integers(0, min(199_000, model.config.vocab_size), prompt_len).tolist(),
                           SamplingParams(max_tokens=new_tokens, temperature=0.0), seed=i))
    steps = []
    while (b := sched.schedule()) is not None:
        t0 = time.perf_counter()
        sched.update(b, runner.run(b).tokens)
        steps.append(time.perf_counter() - t0)
    decode = steps[1:]  # the first step is the prefill
    return batch * len(decode) / sum(decode), 1000 * float(np.mean(decode))


def continuous(model, concurrency: int, requests: int, prompt_len: int, new_tokens: int, dtype) -> float:
    """Output tokens/s of the engine alone (scheduler and paged runner, no server) under bench/peer.py's load:
    `requests` prompts, a new one admitted as soon as one finishes, `concurrency` at a time (prefills beside
    decodes, as a server runs them): the most a server on this engine can stream."""
    runner, sched = _engine(model, dtype)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, min(199_000, model.config.vocab_size), prompt_len).tolist() for _ in range(requests)]
    admitted = running = tokens = 0
    t0 = time.perf_counter()
    while admitted < requests or running:
        while running < concurrency and admitted < requests:
            sched.add(Sequence(f"c{admitted}", prompts[admitted], SamplingParams(max_tokens=new_tokens,
                                                                                temperature=0.0), seed=admitted))
            admitted += 1
            running += 1
        b = sched.schedule()
        assert b is not None, "requests running but none scheduled"
        update = sched.update(b, runner.run(b).tokens)
        tokens += len(update.new_tokens)
        running -= len(update.finished)
    return tokens / (time.perf_counter() - t0)


def prefill_ms(model, length: int, dtype, rounds: int = 3) -> list[float]:
    """Wall milliseconds of one `length`-token prompt's prefill (every step until its first token) through the
    scheduler and paged runner at the server's default step budget, `rounds` times after a warm-up, a new
    random prompt each (no prefix-cache hits)."""
    runner, sched = _engine(model, dtype)
    sched.max_num_batched_tokens = ServerConfig().max_num_batched_tokens
    rng = np.random.default_rng(0)
    out = []
    for i in range(rounds + 1):
        sched.add(Sequence(f"p{i}", rng.integers(0, min(199_000, model.config.vocab_size), length).tolist(),
                           SamplingParams(max_tokens=1, temperature=0.0), seed=i))
        t0 = time.perf_counter()
        while (b := sched.schedule()) is not None:
            sched.update(b, runner.run(b).tokens)
        out.append(1000 * (time.perf_counter() - t0))
    return out[1:]


def hf_generate(path, batch: int, prompt_len: int, new_tokens: int, dtype) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    vocab = min(199_000, hf.config.vocab_size)
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
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
    parser.add_argument("--model", default="tiny-llama-o200k", help=f"a path, or one of {', '.join(CHECKPOINTS)}")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--no-transformers", action="store_true", help="Sluice and the floors alone")
    parser.add_argument("--continuous", type=int, metavar="N", help="instead: N requests kept at each --batches "
                        "concurrency (new prompts beside decodes), the engine's output tokens/s")
    parser.add_argument("--prefill-len", type=int, metavar="L", help="instead: time one L-token prompt's prefill")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    keep_heap_memory()  # as the engine process does
    path = Path(args.model) if Path(args.model).is_dir() else checkpoint(args.model)
    model = load_model(path, dtype, torch.device("cpu"))
    if args.prefill_len:
        times = prefill_ms(model, args.prefill_len, dtype)
        print(f"{path.name}, {args.dtype}: a {args.prefill_len}-token prefill: "
              f"{' / '.join(f'{t:.0f}' for t in times)} ms (min {min(times):.0f})")
        return
    if args.continuous:
        continuous(model, 4, 4, args.prompt_len, 4, dtype)  # warm-up
        for batch in (int(b) for b in args.batches.split(",")):
            tps = continuous(model, batch, args.continuous, args.prompt_len, args.new_tokens, dtype)
            print(f"{path.name}, {args.dtype}: {args.continuous} requests at concurrency {batch}, {args.prompt_len}-"
                  f"token prompts, {args.new_tokens} tokens each: {tps:.0f} output tok/s")
        return
    runner = _engine(model, dtype)[0]
    weights, kv_dtype = weight_bytes(runner), runner.kv_caches[0][0].dtype
    copy_gbps, read_gbps = bandwidth_gbps()
    print(f"{path.name}, {args.dtype}, {torch.get_num_threads()} threads: a step reads {weights / 1e6:.0f} MB of "
          f"weights (+ its KV cache); memcpy {copy_gbps:.1f} GB/s, a read {read_gbps:.1f} GB/s")
    print(f"{'batch':>5} {'sluice tok/s':>13} {'step ms':>8} {'floor ms':>9} {'x floor':>8} {'read floor':>11} "
          f"{'x read':>7} {'transformers tok/s':>19} {'ratio':>6}")
    for batch in (int(b) for b in args.batches.split(",")):
        sluice_decode(model, batch, args.prompt_len, 4, dtype)  # warm-up
        tps, step = sluice_decode(model, batch, args.prompt_len, args.new_tokens, dtype)
        nbytes = weights + kv_bytes(model, batch, args.prompt_len + args.new_tokens // 2, kv_dtype)
        floor_ms, read_ms = nbytes / copy_gbps / 1e6, nbytes / read_gbps / 1e6
        ref = float("nan") if args.no_transformers else hf_generate(path, batch, args.prompt_len, args.new_tokens,
                                                                     dtype)
        print(f"{batch:>5} {tps:>13.0f} {step:>8.2f} {floor_ms:>9.2f} {step / floor_ms:>8.2f} {read_ms:>11.2f} "
              f"{step / read_ms:>7.2f} {ref:>19.0f} {tps / ref:>6.2f}")


if __name__ == "__main__":
    main()
