"""Routers and disaggregation, measured with real servers on loopback.

routing: 2 replicas, requests that share long prefixes (a few of them, each repeated): cache-hit tokens
(the servers' own usage.prompt_tokens_details) and TTFT, through `sluice router --policy kv`, `--policy
round_robin`, and the Rust routers from PyPI when they are installed (sglang-router, vllm-router,
cache_aware). The replicas restart before each router, so each starts cold.

mixed: long prompts beside long generations, aggregated (2 replicas behind `sluice router`) against
disaggregated (1 context + 1 generation worker behind it): the decodes' ITL p99 and the prompts' TTFT.

    python -m bench.router_bench routing --serve-args "--runner replay --replay-step-ms 4 --max-num-batched-tokens 128"
    python -m bench.router_bench mixed
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time

import httpx

from bench.ceiling import tree_cpu
from bench.router import RouterProc
from bench.server import Server, free_port, wait_healthy

MODEL = "builtin:tiny-chat"
SECRET = "bench-secret"
_WORDS = ("river sea mountain snow lake market price number letter friend tool function answer question "
          "science story morning evening weather city light wind server client token stream engine").split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


async def one(client: httpx.AsyncClient, url: str, content: str, max_tokens: int) -> dict:
    """A streaming chat request: TTFT, the gaps between token events, and the cached prompt tokens."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, last, gaps, usage = None, None, [], {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            now = time.perf_counter()
            if event.get("usage"):
                usage = event["usage"]
            if any(c.get("delta", {}).get("content") is not None for c in event.get("choices", [])):
                if first is None:
                    first = now - t0
                elif last is not None:
                    gaps.append(now - last)
                last = now
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft": first or 0.0, "gaps": gaps, "prompt": usage.get("prompt_tokens", 0),
            "cached": details.get("cached_tokens", 0)}


async def load(url: str, jobs: list[tuple[str, int]], concurrency: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        async def run(job):
            async with sem:
                return await one(client, url, *job)
        return await asyncio.gather(*(run(j) for j in jobs))


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (values[0] if values else 0.0)


class External:
    """A router from PyPI (sglang-router, vllm-router), as a process."""

    def __init__(self, cmd: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([*cmd, "--host", "127.0.0.1", "--port", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_healthy(self.proc, self.url, 60)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def routers(urls: list[str], which: list[str]):
    for name in which:
        if name in ("kv", "round_robin"):
            yield f"sluice router --policy {name}", lambda n=name: RouterProc("--workers", *urls, "--model", MODEL,
                                                                               "--policy", n)
        elif name in ("sglang", "vllm"):
            exe = shutil.which("sglang-router" if name == "sglang" else "vllm-router")
            if name == "sglang":
                cmd = [sys.executable, "-m", "sglang_router.launch_router"]
                if not exe:
                    try:
                        import sglang_router  # noqa: F401
                    except ImportError:
                        print(f"({name}-router is not installed: skipped)")
                        continue
            elif exe:
                cmd = [exe]
            else:
                print(f"({name}-router is not installed: skipped)")
                continue
            yield f"{name}-router cache_aware", lambda c=cmd: External(
                [*c, "--worker-urls", *urls, "--policy", "cache_aware"])


def routing(args) -> None:
    rng = random.Random(0)
    prefixes = [text(rng, args.prefix_words) for _ in range(args.prefixes)]
    jobs = [(rng.choice(prefixes) + f" Question {i}: " + text(rng, 8), 8) for i in range(args.requests)]
    serve = shlex.split(args.serve_args)
    print(f"{args.requests} requests over {args.prefixes} shared prefixes of ~{args.prefix_words} words, "
          f"concurrency {args.concurrency}; replicas: sluice serve {args.serve_args}")
    print("| router | cache-hit tokens | of prompt tokens | TTFT p50 ms | TTFT p90 ms | router CPU-ms / request |")
    print("|---|---|---|---|---|---|")
    for name in args.routers:
        replicas = [Server(*serve), Server(*serve)]
        try:
            for label, start in routers([s.url for s in replicas], [name]):
                router = start()
                try:
                    asyncio.run(load(router.url, jobs[:4], 1))  # warm: connections, the first tokenization
                    cpu = tree_cpu(router.proc.pid)
                    out = asyncio.run(load(router.url, jobs[4:], args.concurrency))
                    cpu = tree_cpu(router.proc.pid) - cpu
                except RuntimeError as e:
                    print(f"| {label} | failed: {e} | | | | |")
                    continue
                finally:
                    router.stop()
                ttft = [o["ttft"] * 1000 for o in out]
                print(f"| {label} | {sum(o['cached'] for o in out):,} | {sum(o['prompt'] for o in out):,} | "
                      f"{statistics.median(ttft):.1f} | {pct(ttft, 90):.1f} | {1000 * cpu / len(out):.2f} |")
        finally:
            for s in replicas:
                s.stop()


def mixed(args) -> None:
    rng = random.Random(1)
    jobs = []
    for i in range(args.requests):
        if i % 2:
            jobs.append((f"{i} " + text(rng, args.prefix_words), 4))  # a long prompt, a short answer
        else:
            jobs.append((f"{i} " + text(rng, 8), args.decode_tokens))  # a short prompt, a long generation
    serve = shlex.split(args.serve_args)
    print(f"{args.requests} requests at concurrency {args.concurrency}: half ~{args.prefix_words}-word prompts "
          f"(4 tokens out), half short prompts ({args.decode_tokens} tokens out); sluice serve {args.serve_args}")
    print("| setup | long prompts' TTFT p50 ms | p90 ms | decodes' ITL p50 ms | ITL p99 ms |")
    print("|---|---|---|---|---|")
    for setup in ("aggregated", "disaggregated"):
        if setup == "aggregated":
            servers = [Server(*serve), Server(*serve)]
            router = RouterProc("--workers", *(s.url for s in servers), "--model", MODEL)
        else:
            servers = [Server("--role", "context", "--disagg-secret", SECRET, *serve),
                       Server("--role", "generation", "--disagg-secret", SECRET, *serve)]
            router = RouterProc("--context", servers[0].url, "--generation", servers[1].url, "--disagg-secret", SECRET,
                                "--model", MODEL, "--max-local-prefill", str(args.max_local_prefill))
        try:
            asyncio.run(load(router.url, jobs[:2], 1))
            out = asyncio.run(load(router.url, jobs[2:], args.concurrency))
        finally:
            router.stop()
            for s in servers:
                s.stop()
        ttft = [o["ttft"] * 1000 for o, j in zip(out, jobs[2:]) if j[1] == 4]
        gaps = [g * 1000 for o, j in zip(out, jobs[2:]) if j[1] != 4 for g in o["gaps"]]
        print(f"| {setup} | {statistics.median(ttft):.1f} | {pct(ttft, 90):.1f} | {statistics.median(gaps):.2f} | "
              f"{pct(gaps, 99):.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", choices=["routing", "mixed"])
    ap.add_argument("--routers", nargs="+", default=["kv", "round_robin", "sglang", "vllm"])
    ap.add_argument("--serve-args", default="")
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-words", type=int, default=600)
    ap.add_argument("--requests", type=int, default=68)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--max-local-prefill", type=int, default=128)
    args = ap.parse_args()
    routing(args) if args.scenario == "routing" else mixed(args)


if __name__ == "__main__":
    main()
