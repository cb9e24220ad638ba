"""Disaggregated serving by hand (what `sluice router` does): a context_only request to a context worker,
then its answer's disaggregated_params in a generation_only request to a generation worker."""
from __future__ import annotations

import json
from pathlib import Path

import httpx

from bench.server import Server

SECRET = "test-secret"
HEADERS = {"x-sluice-disagg-secret": SECRET}


class Trio:
    def __init__(self, ctx_args: tuple = (), gen_args: tuple = (), common: tuple = (), agg: bool = True) -> None:
        """`agg=False`: no aggregated server (the test compares with another one, or with known tokens)."""
        self.ctx = Server("--role", "context", "--disagg-secret", SECRET, *common, *ctx_args)
        self.gen = Server("--role", "generation", "--disagg-secret", SECRET, *common, *gen_args)
        self.agg = Server(*common) if agg else None
        self.gen_timing: Path | None = None  # the generation worker's --kv-timing-output, where it has one
        self.ctx_timing: Path | None = None  # the context worker's

    def stop(self) -> None:
        for s in (self.ctx, self.gen, self.agg):
            assert s is None or s.stop() == 0, s.output()


def context_answer(url: str, path: str, body: dict, params: dict | None = None) -> dict:
    """A context worker's whole answer (TensorRT-LLM's shape: one choice carries the disaggregated_params)."""
    hand_off = {"request_type": "context_only", **(params or {})}
    r = httpx.post(url + path, json={**body, "disaggregated_params": hand_off}, headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def context(url: str, path: str, body: dict) -> dict:
    return context_answer(url, path, body)["choices"][0]["disaggregated_params"]


def generation(url: str, path: str, body: dict, params: dict) -> httpx.Response:
    return httpx.post(url + path, json={**body, "disaggregated_params": {**params, "request_type": "generation_only"}},
                      headers=HEADERS, timeout=60)


def two_hop(ctx: Server, gen: Server, path: str, body: dict) -> httpx.Response:
    return generation(gen.url, path, body, context(ctx.url, path, body))


def comparable(r: httpx.Response, stream: bool) -> list:
    """What must be equal between two servers' answers: each choice's text, tool calls, finish reason and
    token ids (ids, created and timings differ)."""
    assert r.status_code == 200, r.text
    if not stream:
        return [_choice(c) for c in r.json()["choices"]]
    merged: dict[int, dict] = {}
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for c in json.loads(line[6:]).get("choices", []):
            m = merged.setdefault(c["index"], {"text": "", "finish": None, "ids": []})
            d = c.get("delta", c)
            m["text"] += d.get("content") or d.get("text") or ""
            m["finish"] = c.get("finish_reason") or m["finish"]
            m["ids"] += c.get("token_ids") or []
    return [merged[i] for i in sorted(merged)]


def _choice(c: dict) -> dict:
    m = c.get("message") or {}
    calls = [(t["function"]["name"], t["function"]["arguments"]) for t in m.get("tool_calls") or []]
    return {"text": c.get("text", m.get("content")), "reasoning": m.get("reasoning_content"), "calls": calls,
            "finish": c["finish_reason"], "ids": c.get("token_ids")}


def kv_used(server: Server) -> float:
    return server.metrics()["sluice:kv_cache_used_blocks"]
