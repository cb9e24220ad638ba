"""The gRPC door (`sluice serve --grpc`) against the HTTP API, on loopback: the same streamed greedy requests
(tiny-chat, every request `--max-tokens` tokens: ignore_eos) through

  http    Sluice's own HTTP API (OpenAI chat, SSE);
  router  sglang-router 0.3.2 in gRPC mode in front of the door (its OpenAI chat, SSE);
  grpc    a Python gRPC client of the door (the protocol's Generate, the prompt as token ids).

Each path: wall time for `--requests` requests `--concurrency` at a time, output tokens/s, and time to the first
token (p50 / p90).

    python -m bench.grpc_door [--requests 64] [--concurrency 16] [--max-tokens 128]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time

import grpc
import httpx

from bench.server import Server, free_port
from sluice.app.builtin_models import ensure_builtin
from sluice.base.harmony_vocab import ensure_vocab
from sluice.ingress.grpc import sglang_scheduler_pb2 as pb

MODEL = "builtin:tiny-chat"
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat and a river"}]


async def _chat(client: httpx.AsyncClient, url: str, max_tokens: int) -> float:
    """Seconds to the first content chunk."""
    start, first = time.perf_counter(), 0.0
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not first and line.startswith("data: {") and '"content":"' in line:
                first = time.perf_counter() - start
    return first


async def _generate(stub, ids: list[int], max_tokens: int, n: int) -> float:
    start, first, tokens = time.perf_counter(), 0.0, 0
    request = pb.GenerateRequest(request_id=f"bench-{n}", tokenized=pb.TokenizedInput(input_ids=ids), stream=True,
                                 sampling_params=pb.SamplingParams(temperature=0, top_p=1, top_k=-1,
                                                                   max_new_tokens=max_tokens, ignore_eos=True))
    async for response in stub(request):
        if response.chunk.token_ids and not first:
            first = time.perf_counter() - start
        tokens += len(response.chunk.token_ids)
    assert tokens == max_tokens, tokens
    return first


async def _run(one, requests: int, concurrency: int) -> tuple[float, list[float]]:
    gate = asyncio.Semaphore(concurrency)

    async def bounded(n: int) -> float:
        async with gate:
            return await one(n)

    start = time.perf_counter()
    ttfts = await asyncio.gather(*(bounded(n) for n in range(requests)))
    return time.perf_counter() - start, list(ttfts)


async def measure(path: str, url: str, grpc_port: int, ids: list[int], args) -> dict:
    if path == "grpc":
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = channel.unary_stream("/sglang.grpc.scheduler.SglangScheduler/Generate",
                                    request_serializer=pb.GenerateRequest.SerializeToString,
                                    response_deserializer=pb.GenerateResponse.FromString)
        one = lambda n: _generate(stub, ids, args.max_tokens, n)  # noqa: E731
    else:
        client = httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.concurrency))
        one = lambda n: _chat(client, url, args.max_tokens)  # noqa: E731
    await _run(one, args.concurrency, args.concurrency)  # warm-up
    wall, ttfts = await _run(one, args.requests, args.concurrency)
    if path == "grpc":
        await channel.close()
    else:
        await client.aclose()
    q = statistics.quantiles(ttfts, n=10)
    return {"path": path, "wall_s": round(wall, 2), "tokens_per_s": round(args.requests * args.max_tokens / wall),
            "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1), "ttft_p90_ms": round(q[8] * 1000, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="each path this many times, interleaved")
    args = ap.parse_args(argv)
    server = Server("--grpc", "0")
    router = None
    try:
        m = re.search(r"gRPC \(.*\) on \S+:(\d+)", server.output())
        assert m, server.output()
        grpc_port = int(m.group(1))
        ids = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": MESSAGES, "max_tokens": 1, "return_token_ids": True}).json()["prompt_token_ids"]
        port = free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--worker-urls", f"grpc://127.0.0.1:{grpc_port}", "--tokenizer-path", str(ensure_builtin("tiny-chat")),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn"],
            env={**os.environ, "TIKTOKEN_ENCODINGS_BASE": ensure_vocab()}, stdout=subprocess.DEVNULL)
        router_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(router_url + "/v1/models", timeout=2).json()["data"]:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            assert time.monotonic() < deadline and router.poll() is None, "the router did not start"
            time.sleep(0.2)
        for _ in range(args.rounds):
            for path, url in (("http", server.url), ("router", router_url), ("grpc", "")):
                print(json.dumps(asyncio.run(measure(path, url, grpc_port, ids, args))), flush=True)
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        server.stop()


if __name__ == "__main__":
    main()
