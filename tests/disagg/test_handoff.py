"""A prompt's KV computed by a context worker and decoded on by a generation worker gives the aggregated
server's tokens; the hand-off is the orchestrator's alone; leases end and free their blocks."""
from __future__ import annotations

import base64
import json
import re
import time

import httpx
import numpy as np
import pytest

from tests.disagg.helpers import HEADERS, comparable, context, context_answer, generation, kv_used, two_hop

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
    answer = context_answer(trio.ctx.url, "/v1/chat/completions", {**CHAT, "n": 2, "temperature": 1.0, "seed": 1},
                            {"return_prompt_token_ids_b64": True})
    assert answer["object"] == "chat.completion" and len(answer["choices"]) == 1  # (TensorRT-LLM's shape)
    choice = answer["choices"][0]
    params = choice["disaggregated_params"]
    assert choice["finish_reason"] == "not_finished" and choice["message"]["role"] == "assistant"
    assert params["request_type"] == "context_only" and len(params["first_gen_tokens"]) == 2
    assert params["encoded_opaque_state"] and isinstance(params["ctx_request_id"], int)
    assert params["disagg_request_id"] == params["ctx_request_id"]
    ids = answer["prompt_token_ids"]
    assert answer["usage"]["prompt_tokens"] == len(ids) > 0
    assert answer["prompt_token_ids_b64"] == base64.b64encode(np.asarray(ids, dtype="<i4").tobytes()).decode()
    assert kv_used(trio.ctx) > 0  # held under the lease until a generation worker reads it (or it expires)
    r = generation(trio.gen.url, "/v1/chat/completions", {**CHAT, "n": 2, "temperature": 1.0, "seed": 1}, params)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert _settled(trio.ctx) == 0


def test_a_generation_worker_renders_nothing_it_takes_the_prompt_ids(trio):
    answer = context_answer(trio.ctx.url, "/v1/chat/completions", CHAT)
    other = {**CHAT, "messages": [{"role": "user", "content": "something else entirely"}]}
    r = generation(trio.gen.url, "/v1/chat/completions", {**other, "return_token_ids": True},
                   answer["choices"][0]["disaggregated_params"])
    assert r.json()["prompt_token_ids"] == answer["prompt_token_ids"]


def test_fields_a_worker_does_not_know_are_ignored_but_unknown_request_fields_stay_a_400(trio):
    req = {**CHAT, "temperature": 0, "return_token_ids": True}
    want = comparable(httpx.post(trio.agg.url + "/v1/chat/completions", json=req, timeout=60), False)
    newer = {"schedule_style": 0, "a_field_of_tomorrow": {"x": 1}}  # (a newer orchestrator's)
    params = context_answer(trio.ctx.url, "/v1/chat/completions", req, newer)["choices"][0]["disaggregated_params"]
    assert comparable(generation(trio.gen.url, "/v1/chat/completions", req, {**params, **newer}), False) == want
    assert "ignoring the fields this worker does not know: a_field_of_tomorrow" in trio.gen.output()
    r = httpx.post(trio.ctx.url + "/v1/chat/completions", headers=HEADERS, timeout=30,
                   json={**CHAT, "a_field_of_tomorrow": 1, "disaggregated_params": {"request_type": "context_only"}})
    assert r.status_code == 400 and "a_field_of_tomorrow" in r.json()["error"]["message"], r.text


def test_kv_hints_are_the_orchestrators_alone(trio):
    hints = {"protocol_version": "0.1", "message_id": "m", "actions": [{"action_type": "kv.retain"}]}
    r = httpx.post(trio.agg.url + "/v1/chat/completions", json={**CHAT, "kv_hints": hints}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["param"] == "kv_hints", r.text
    r = httpx.post(trio.ctx.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2, "kv_hints": hints},
                   headers=HEADERS, timeout=30)
    assert r.status_code == 200, r.text  # (the orchestrator's: taken, though no hint is acted on yet)


@pytest.mark.parametrize("headers, status", [({}, 403), ({"x-sluice-disagg-secret": "guess"}, 403)])
def test_clients_cannot_send_disaggregated_params(trio, headers, status):
    """(The context worker takes unsigned context_only requests, as TensorRT-LLM's orchestrator sends them:
    test_trtllm_orchestrator.py; not with a proof that fails.)"""
    servers = [(trio.gen, "generation_only"), (trio.agg, "context_only")]
    servers += [(trio.ctx, "context_only")] if headers else []
    for server, kind in servers:
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


def test_prompt_logprobs_come_from_the_context_worker_through_the_generation_workers_answer(trio):
    """The context worker scores the prompt and its opaque state carries the scores; the generation worker's
    answer has them where the aggregated server's are (a completion choice's; a chat completion's, top level,
    from the same engine output), and the same."""
    path, body = "/v1/completions", {**COMPLETION, "echo": True}
    req = {**body, "prompt_logprobs": 2, "temperature": 0, "max_tokens": 4, "return_token_ids": True}
    want = httpx.post(trio.agg.url + path, json=req, timeout=60)
    got = two_hop(trio.ctx, trio.gen, path, req)
    assert comparable(got, False) == comparable(want, False)
    w, g = (r.json()["choices"][0]["prompt_logprobs"] for r in (want, got))
    assert w[0] is None and g[0] is None and len(g) == len(w) > 10
    for a, b in zip(w[1:], g[1:]):
        assert {t: (e["rank"], e["decoded_token"]) for t, e in a.items()} == \
            {t: (e["rank"], e["decoded_token"]) for t, e in b.items()}
        assert all(abs(a[t]["logprob"] - b[t]["logprob"]) < 1e-4 for t in a)
    params = context(trio.ctx.url, path, {**req, "prompt_logprobs": 1})
    r = generation(trio.gen.url, path, req, params)  # (asks for more than the context worker scored)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    assert generation(trio.gen.url, path, {**req, "prompt_logprobs": 1}, params).status_code == 200


def _logprobs(r: httpx.Response, chat: bool) -> list:
    """Each choice's tokens' logprobs, and their most likely alternatives'."""
    assert r.status_code == 200, r.text
    out = []
    for c in r.json()["choices"]:
        if chat:
            out.append([(t["token"], t["logprob"], [(a["token"], a["logprob"]) for a in t["top_logprobs"]])
                        for t in c["logprobs"]["content"]])
        else:
            lp = c["logprobs"]
            out.append([(t, p, sorted(top.items())) for t, p, top in zip(lp["tokens"], lp["token_logprobs"],
                                                                          lp["top_logprobs"])])
    return out


@pytest.mark.parametrize("path, body, asks", [
    ("/v1/chat/completions", CHAT, {"logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", COMPLETION, {"logprobs": 2}),
], ids=["chat", "completions"])
def test_logprobs_are_served_as_a_pair_the_first_tokens_carried(trio, path, body, asks):
    req = {**body, **asks, "temperature": 1.0, "seed": 5, "n": 2}
    want = _logprobs(httpx.post(trio.agg.url + path, json=req, timeout=60), path != "/v1/completions")
    params = context(trio.ctx.url, path, req)
    assert [p[0]["token_id"] for p in params["first_gen_log_probs"]] == params["first_gen_tokens"]
    got = _logprobs(generation(trio.gen.url, path, req, params), path != "/v1/completions")
    assert [[t for t, _, _ in c] for c in got] == [[t for t, _, _ in c] for c in want]
    for g, w in zip(sum(got, []), sum(want, [])):
        assert g[1] == pytest.approx(w[1], abs=1e-3) and [t for t, _ in g[2]] == [t for t, _ in w[2]]
    without = {k: v for k, v in req.items() if k not in asks}
    plain = context(trio.ctx.url, path, without)
    r = generation(trio.gen.url, path, req, plain)  # (a context answer without the first tokens' logprobs)
    assert r.status_code == 400 and r.json()["error"]["param"] == "disaggregated_params.first_gen_log_probs"
    assert generation(trio.gen.url, path, without, plain).status_code == 200  # (its lease read: none left to expire)


def test_the_kv_timing_output_records_each_transfers_start_and_end_on_both_sides(trio):
    """The generation worker's line: its read; the context worker's: the lease, from its answer to the release
    (TensorRT-LLM's send and recv sides)."""
    def transfers(path) -> list[dict]:
        lines = path.read_text().splitlines() if path.exists() else []
        return [r["kv_transfer"] for r in map(json.loads, lines) if "kv_transfer" in r]

    before, sent_before = len(transfers(trio.gen_timing)), len(transfers(trio.ctx_timing))
    t0 = time.time()
    unique = {**CHAT, "temperature": 0, "messages": [{"role": "user", "content": f"Timed at {t0}. " * 20}]}
    assert two_hop(trio.ctx, trio.gen, "/v1/chat/completions", unique).status_code == 200  # (nothing cached)
    new = transfers(trio.gen_timing)[before:]
    assert len(new) == 1 and new[0]["outcome"] == "read" and new[0]["backend"] == "shm" and new[0]["side"] == "recv"
    assert t0 <= new[0]["start"] <= new[0]["end"] <= time.time() and new[0]["bytes"] > 0 and new[0]["blocks"] > 0
    deadline = time.monotonic() + 10
    while not (sent := [t for t in transfers(trio.ctx_timing)[sent_before:] if t["outcome"] == "released"
                        and t["start"] >= t0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(sent) == 1 and sent[0]["side"] == "send" and sent[0]["backend"] == "shm", sent
    assert t0 <= sent[0]["start"] <= new[0]["start"] <= new[0]["end"] <= sent[0]["end"]
    assert sent[0]["bytes"] >= new[0]["bytes"] and sent[0]["blocks"] >= new[0]["blocks"]


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
    forged = {**params, "encoded_opaque_state": "bm90IGEgaGFuZGxl"}  # "not a handle"
    assert comparable(generation(trio.gen.url, "/v1/completions", req, forged), False) == want
    assert _settled(trio.ctx, 8.0) == 0 and _settled(trio.gen) == 0
