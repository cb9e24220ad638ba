"""What a msgpack request body costs the ingress over the same body as JSON: the msgpack body is read as its
JSON form (ingress/formats.py: decode, check, encode) and then decoded as the JSON is.

    python -m bench.msgpack_body

Prints, for a few request shapes, the µs of the JSON decode into the request Struct and of the msgpack path
(best of 5 rounds)."""
from __future__ import annotations

import time
from typing import Any, Callable

import msgspec

from sluice.ingress.formats import msgpack_as_json
from sluice.schemas.openai import ChatCompletionRequest, CompletionRequest

CASES: dict[str, tuple[type, dict[str, Any]]] = {
    "chat, 1 KB": (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hello " * 150}],
                                           "max_tokens": 16, "temperature": 0.7}),
    "chat, 50 messages, 100 KB": (ChatCompletionRequest, {"model": "m", "max_tokens": 16, "messages": [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 400} for i in range(50)]}),
    "chat, one 1 MB message": (ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": "word " * 200_000}]}),
    "completion, 32k token ids": (CompletionRequest, {"model": "m", "prompt": list(range(32_000)), "max_tokens": 16}),
}


def best_us(fn: Callable[[], Any], n: int) -> float:
    fn()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    return min(rounds)


def main() -> None:
    print("| request | JSON bytes | msgpack bytes | JSON µs | msgpack µs | extra µs |")
    print("|---|---|---|---|---|---|")
    for name, (cls, value) in CASES.items():
        decoder: msgspec.json.Decoder = msgspec.json.Decoder(cls)
        as_json, as_msgpack = msgspec.json.encode(value), msgspec.msgpack.encode(value)
        n = 2000 if len(as_json) < 10_000 else 100
        json_us = best_us(lambda: decoder.decode(as_json), n)
        msgpack_us = best_us(lambda: decoder.decode(msgpack_as_json(as_msgpack)), n)
        print(f"| {name} | {len(as_json):,} | {len(as_msgpack):,} | {json_us:.1f} | {msgpack_us:.1f} | "
              f"{msgpack_us - json_us:.1f} |")


if __name__ == "__main__":
    main()
