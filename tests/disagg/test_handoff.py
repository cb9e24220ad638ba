"""A prompt's KV computed by a context worker and decoded on by a generation worker gives the aggregated
server's tokens; the hand-off is the orchestrator's alone; leases end and free their blocks."""
from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.disagg.helpers import HEADERS, comparable, context, generation, kv_used, two_hop

MODEL = "builtin:tiny-chat"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the river and the sea. " * 6}],
        "max_tokens": 24}
COMPLETION = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog " * 5, "max_tokens": 24}


def _settled(server, deadline_s: float = 5.0) -> float:
    """The server's used KV blocks once its leases and requests are done (waits a moment for releases)."""
    deadline = time.monotonic() + deadline_s
    while (used := kv_used(server)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return used


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)],
                         ids=["chat", "completions"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7},
                                      {"temperature": 0.8, "seed": 11, "n": 3},
                                      {"temperature": 0, "stream": True},
                                      {"temperature": 1.0, "seed": 3, "n": 2, "stream": True}],
                         ids=["greedy", "seeded", "seeded-n3", "greedy-stream", "seeded-n2-stream"])
def test_disaggregated_tokens_equal_the_aggregated_servers(trio, path, body, sampling):
    req = {**body, **sampling, "return_token_ids": True}
    stream = bool(sampling.get("stream"))
    want = comparable(httpx.post(trio.agg.url + path, json=req, timeout=60), stream)
    got = comparable(two_hop(trio.ctx, trio.gen, path, req), stream)
    assert got == want
    assert _settled(trio.ctx) == 0 and _settled(trio.gen) == 0


def test_the_context_answer_has_the_first_tokens_the_handle_and_the_prompt(trio):
    params = context(trio.ctx.url, "/v1/chat/completions", {**CHAT, "n": 2, "temperature": 1.0, "seed": 1})
    assert params["request_type"] == "context_only" and len(params["first_gen_tokens"]) == 2
    assert params["opaque_state"] and params["prompt_token_ids_b64"] and params["ctx_request_id"]
    assert kv_used(trio.ctx) > 0  # held under the lease until a generation worker reads it (or it expires)
    r = generation(trio.gen.url, "/v1/chat/completions", {**CHAT, "n": 2, "temperature": 1.0, "seed": 1}, params)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert _settled(trio.ctx) == 0


def test_a_generation_worker_renders_nothing_it_takes_the_prompt_ids(trio):
    params = context(trio.ctx.url, "/v1/chat/completions", CHAT)
    other = {**CHAT, "messages": [{"role": "user", "content": "something else entirely"}]}
    r = generation(trio.gen.url, "/v1/chat/completions", {**other, "return_prompt_token_ids_b64": True}, params)
    assert r.json()["prompt_token_ids_b64"] == params["prompt_token_ids_b64"]


@pytest.mark.parametrize("headers, status", [({}, 403), ({"x-sluice-disagg-secret": "guess"}, 403)])
def test_clients_cannot_send_disaggregated_params(trio, headers, status):
    for server, kind in ((trio.ctx, "context_only"), (trio.gen, "generation_only"), (trio.agg, "context_only")):
        r = httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=30,
                       json={**CHAT, "disaggregated_params": {"request_type": kind}})
        assert r.status_code == status and r.json()["error"]["param"] == "disaggregated_params", r.text
        r = httpx.post(server.url + "/v1/messages", timeout=30, headers={
            **headers, "x-sluice-disaggregated-params": '{"request_type": "%s"}' % kind},
            json={"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == status, r.text
    ok = httpx.post(trio.agg.url + "/v1/chat/completions", json={**CHAT, "prompt_token_ids_b64": "AQAAAA=="},
                    timeout=30)
    assert ok.status_code == 200  # prompt ids stay open to every client


def test_a_worker_takes_only_its_roles_request_type(trio):
    r = httpx.post(trio.gen.url + "/v1/chat/completions", headers=HEADERS, timeout=30,
                   json={**CHAT, "disaggregated_params": {"request_type": "context_only"}})
    assert r.status_code == 400 and "role is generation" in r.json()["error"]["message"]
    r = httpx.post(trio.gen.url + "/v1/chat/completions", headers=HEADERS, timeout=30,
                   json={**CHAT, "disaggregated_params": {"request_type": "generation_only"}})
    assert r.status_code == 400 and "opaque_state" in r.json()["error"]["message"]
    r = httpx.post(trio.ctx.url + "/v1/chat/completions", headers=HEADERS, timeout=30,
                   json={**CHAT, "logprobs": True, "top_logprobs": 1,
                         "disaggregated_params": {"request_type": "context_only"}})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]


def _expired_leases(server) -> float:
    m = re.search(r'^sluice:kv_leases_total\{end="expired"\} (\S+)$', httpx.get(server.url + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_an_expired_lease_frees_its_blocks_and_the_generation_worker_recomputes(trio):
    req = {**CHAT, "temperature": 0, "return_token_ids": True}
    want = comparable(httpx.post(trio.agg.url + "/v1/chat/completions", json=req, timeout=60), False)
    expired = _expired_leases(trio.ctx)
    params = context(trio.ctx.url, "/v1/chat/completions", req)
    assert kv_used(trio.ctx) > 0
    assert _settled(trio.ctx, 8.0) == 0  # the lease (3 s here) expired unread
    r = generation(trio.gen.url, "/v1/chat/completions", req, params)
    assert comparable(r, False) == want  # --kv-load-failure recompute (the default)
    assert _expired_leases(trio.ctx) == expired + 1
    assert _settled(trio.gen) == 0


def test_a_bad_handle_is_recomputed_or_failed(trio):
    req = {**COMPLETION, "temperature": 0, "return_token_ids": True}
    want = comparable(httpx.post(trio.agg.url + "/v1/completions", json=req, timeout=60), False)
    params = context(trio.ctx.url, "/v1/completions", req)
    forged = {**params, "opaque_state": "bm90IGEgaGFuZGxl"}  # "not a handle"
    assert comparable(generation(trio.gen.url, "/v1/completions", req, forged), False) == want
    assert _settled(trio.ctx, 8.0) == 0 and _settled(trio.gen) == 0
