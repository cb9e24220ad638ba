"""TTFT with and without prefix caching: a shared ~1,000-token system prompt,
64 concurrent streaming chat requests that differ only in the user turn.

Starts `sluice serve` twice on the same model (with and without
--no-prefix-caching), runs the same load against each, and prints TTFT
percentiles and their ratio.

    python -m bench.prefix_ttft [--model builtin:tiny-chat] [--concurrency 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from bench.server import Server

WORDS = ("river market letter mountain function argument server client stream token engine worker "
         "morning evening history science question answer article reader weather city").split()


def system_prompt(words: int) -> str:
    return " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(words))


async def one(client: httpx.AsyncClient, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise RuntimeError("stream ended without a token")


async def load(base: str, model: str, system: str, concurrency: int, rounds: int) -> list[float]:
    url = base + "/v1/chat/completions"

    def body(i: int) -> dict:
        return {"model": model, "stream": True, "max_tokens": 8, "ignore_eos": True,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}]}

    ttfts: list[float] = []
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency)) as client:
        await one(client, url, body(-1))  # warm-up: the system prompt is in the cache, as in production
        for r in range(rounds):
            ttfts += await asyncio.gather(*[one(client, url, body(r * concurrency + i)) for i in range(concurrency)])
    return ttfts


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1000 if len(values) > 1 else values[0] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-chat")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--system-words", type=int, default=650, help="~1,000 tokens with tiny-chat")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    system = system_prompt(args.system_words)
    results = {}
    for name, flags in (("prefix caching", []), ("no prefix caching", ["--no-prefix-caching"])):
        server = Server("--model", args.model, *flags)
        try:
            ttfts = asyncio.run(load(server.url, args.model, system, args.concurrency, args.rounds))
            prompt_tokens = httpx.post(server.url + "/v1/chat/completions", json={
                "model": args.model, "max_tokens": 1,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Question 0?"}],
            }).json()["usage"]["prompt_tokens"]
        finally:
            server.stop()
        results[name] = {"p50_ms": pct(ttfts, 50), "p90_ms": pct(ttfts, 90), "mean_ms": statistics.mean(ttfts) * 1000,
                         "requests": len(ttfts), "prompt_tokens": prompt_tokens}
    on, off = results["prefix caching"], results["no prefix caching"]
    print(f"prompt: {on['prompt_tokens']} tokens; {args.concurrency} concurrent x {args.rounds} rounds")
    print(f"{'':20} {'TTFT p50 ms':>12} {'p90 ms':>10} {'mean ms':>10}")
    for name, r in results.items():
        print(f"{name:20} {r['p50_ms']:>12.1f} {r['p90_ms']:>10.1f} {r['mean_ms']:>10.1f}")
    print(f"TTFT p50 without / with prefix caching: {off['p50_ms'] / on['p50_ms']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
