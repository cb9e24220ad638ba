"""A server with a tiny KV cache and step budget: preemption and chunked prefill end to end."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from bench.server import Server
from tests.e2e.conftest import MODEL


@pytest.fixture(scope="module")
def small():
    s = Server("--num-kv-blocks", "40", "--max-model-len", "512", "--max-num-batched-tokens", "32")
    yield s
    assert s.stop() == 0, s.output()


def _requests():
    reqs = []
    for i in range(32):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {i} " * (1 + i % 5)}],
                "max_tokens": 40, "ignore_eos": True}
        body.update({"temperature": 0} if i % 2 else {"temperature": 1.0, "seed": i})
        reqs.append(body)
    return reqs


async def _run_all(url: str, reqs: list[dict]) -> list[str]:
    async with httpx.AsyncClient(timeout=120) as c:
        responses = await asyncio.gather(*[c.post(url + "/v1/chat/completions", json=r) for r in reqs])
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    return [r.json()["choices"][0]["message"]["content"] for r in responses]


def test_preemption_completes_everything_with_unchanged_outputs(small, server):
    reqs = _requests()
    reference = asyncio.run(_run_all(server.url, reqs))  # the roomy shared server
    constrained = asyncio.run(_run_all(small.url, reqs))
    m = small.metrics()
    assert m["sluice:num_preemptions_total"] > 0
    assert constrained == reference
    assert m["sluice:kv_cache_used_blocks"] == 0


def test_a_long_prompt_does_not_freeze_running_streams(small):
    started = threading.Event()

    def stream():
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", small.url + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                started.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert started.wait(30)
    m = small.metrics()
    before, steps_before, busy_before = (m["sluice:generation_tokens_total"], m["sluice:engine_steps_total"],
                                         m["sluice:engine_busy_seconds_total"])
    long_body = {"model": MODEL, "prompt": list(range(1, 450)), "max_tokens": 1}
    r = httpx.post(small.url + "/v1/completions", json=long_body, timeout=120)
    m = small.metrics()
    after = m["sluice:generation_tokens_total"]
    assert m["sluice:engine_steps_total"] - steps_before >= 449 // 32
    assert m["sluice:engine_busy_seconds_total"] > busy_before
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 449
    t.join(60)
    # 449 prompt tokens in steps of at most 32 tokens, the stream's decode first in each: the stream
    # kept getting a token every step while the prompt was being admitted.
    assert after - before >= 449 // 31, after - before
