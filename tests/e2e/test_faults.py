"""Faults under load, small (bench/faults.py runs the same scenarios large)."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import faults
from tests.e2e.conftest import MODEL


@pytest.fixture(scope="module")
def fleet():
    s = faults.fleet()
    yield s
    assert s.stop() == 0, s.output()


def served(server) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text


def test_kill_a_render_worker_under_load(fleet):
    counts = faults.kill_render(fleet, 8)
    assert counts["hung"] == counts["cut"] == 0, counts
    # the jobs it was stopped on, never rendered, got errors; the others went on
    assert counts["error"] >= 1 and counts["ok"] >= 1, counts
    served(fleet)
    faults.wait_idle(fleet)


def test_requests_already_decoding_outlive_the_render_workers_that_rendered_them():
    slow = faults.fleet("--runner", "replay", "--replay-step-ms", "20")  # 200 tokens: 4 s of decoding
    try:
        counts = faults.kill_renders_while_decoding(slow, 16, 200)
        assert counts == {"ok": 16, "error": 0, "cut": 0, "hung": 0}, counts
        served(slow)
    finally:
        assert slow.stop() == 0, slow.output()


def test_kill_a_postproc_worker_under_load(fleet):
    counts = faults.kill_postproc(fleet, 8)
    assert counts["hung"] == counts["cut"] == 0, counts
    served(fleet)
    faults.wait_idle(fleet)


def test_kill_an_ingress_worker_under_load(fleet):
    counts = faults.kill_ingress_worker(fleet, 8)
    assert counts["hung"] == counts["error"] == 0, counts  # its clients lose the connection, nothing hangs
    faults.wait_idle(fleet)  # the dead worker's requests were dropped, not left running
    for _ in range(4):
        served(fleet)


def test_clients_that_disconnect_mid_stream(fleet):
    result = faults.disconnects(fleet, 200)
    assert result["tokens_after_idle"] == 0 and result["tokens_generated"] < 200 * 100, result


def test_idle_then_active_connections(fleet):
    statuses = faults.idle_then_active(fleet, 1000)
    assert set(statuses) <= {200, 503} and statuses.get(200, 0) > 0, statuses
    faults.wait_idle(fleet)


json_values = st.recursive(st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False)
                           | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
fields = st.sampled_from(["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
                          "logprobs", "top_logprobs", "stream", "logit_bias", "tools", "tool_choice",
                          "response_format", "prompt_token_ids_b64", "echo", "min_p", "top_k", "junk"])


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       body=st.dictionaries(fields, json_values, max_size=6), valid_model=st.booleans())
def test_fuzzed_bodies_never_get_a_5xx(fleet, path, body, valid_model):
    if valid_model:
        body["model"] = MODEL
    body["stream"] = False
    body.setdefault("max_tokens", 8)  # (a body that happens to be valid need not generate to the model's length)
    r = httpx.post(fleet.url + path, content=json.dumps(body), timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert {"message", "type", "param", "code"} <= set(r.json()["error"])
