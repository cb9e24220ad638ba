"""Render work is bounded (issue 37), on one real server with one render worker: a long truncation takes a few
renders and leaves the worker to the next request, a render past --render-timeout is a 408 naming it, a client
that leaves stops its render, a chain of stored responses that loops ends, and a render worker stuck on a job
turns /health and /ready to 503 until it goes on."""
from __future__ import annotations

import re
import sqlite3
import threading
import time

import httpx
import pytest

from bench import faults
from bench.server import Server
from tests.e2e.conftest import MODEL

FOREVER = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
RENDER_TIMEOUT, GRAMMAR_TIMEOUT, STALL_TIMEOUT = 2, 1, 2


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    return tmp_path_factory.mktemp("state")


@pytest.fixture(scope="module")
def server(state):
    s = Server("--render-workers", "1", "--max-model-len", "2048", "--render-timeout", str(RENDER_TIMEOUT),
               "--grammar-compile-timeout", str(GRAMMAR_TIMEOUT), "--stall-timeout", str(STALL_TIMEOUT),
               "--trust-request-chat-template", "--state-dir", str(state))
    yield s
    assert s.stop() == 0, s.output()


def chat(server: Server, timeout: float = 30, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=timeout)


def timed(fn) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    r = fn()
    return r, time.monotonic() - start


def test_a_1600_item_truncation_leaves_the_render_worker_to_a_chat_beside_it(server):
    items = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i} words"} for i in range(1600)]
    body = {"model": MODEL, "input": items, "truncation": "auto", "max_output_tokens": 4, "store": False}
    got = {}
    truncating = threading.Thread(target=lambda: got.update(r=timed(
        lambda: httpx.post(server.url + "/v1/responses", json=body, timeout=120))))
    truncating.start()
    time.sleep(0.05)  # (its job first in the render worker's queue)
    beside, beside_s = timed(lambda: chat(server))
    truncating.join()
    (r, truncated_s) = got["r"]
    assert r.status_code == 200, r.text
    assert 0 < r.json()["usage"]["input_tokens"] <= 2048 - 4
    # one render a dropped turn took 6 s here, and the chat waited as long (a bound generous for loaded cores:
    # tests/render/test_truncation.py counts the renders)
    assert beside.status_code == 200 and beside_s < 10 and truncated_s < 10, (beside_s, truncated_s)


def test_a_render_past_render_timeout_is_a_408_naming_it_and_the_worker_goes_on(server):
    r = chat(server, chat_template=FOREVER)
    assert r.status_code == 408, r.text
    error = r.json()["error"]  # (the template's own limit, 5 s, would have been a 400 naming chat_template)
    assert error["code"] == "render_timeout" and f"--render-timeout ({RENDER_TIMEOUT}s)" in error["message"]
    assert chat(server).status_code == 200


def test_a_client_that_leaves_stops_its_render(server):
    stopped = r"render of \S+ stopped: its request was aborted"
    before = len(re.findall(stopped, server.output()))
    with pytest.raises(httpx.ReadTimeout):
        chat(server, timeout=0.5, chat_template=FOREVER)
    deadline = time.monotonic() + 30  # (a render that ran to its deadline says "timeout", never this)
    while len(re.findall(stopped, server.output())) == before:
        assert time.monotonic() < deadline, "the render went on to its deadline: " + server.output()[-2000:]
        time.sleep(0.05)
    assert chat(server).status_code == 200


def test_a_chain_of_stored_responses_that_loops_ends(server, state):
    def create(**fields) -> str:
        r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "max_output_tokens": 2, **fields},
                       timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["id"]

    first = create(input="one")
    second = create(input="two", previous_response_id=first)
    with sqlite3.connect(state / "sluice.sqlite3") as db:  # damaged state: the first now follows the second
        db.execute("UPDATE responses SET previous_response_id = ? WHERE id = ?", (second, first))
    r = httpx.post(server.url + "/v1/responses", timeout=30, json={
        "model": MODEL, "input": "three", "previous_response_id": second, "max_output_tokens": 2, "store": False})
    assert r.status_code == 200, r.text  # (a walk that went round would never answer: the client's 30 s bound)
    assert "loops back" in server.output()
    assert chat(server).status_code == 200


def test_a_render_worker_stuck_on_a_job_turns_health_and_ready_to_503(server):
    limit = RENDER_TIMEOUT + GRAMMAR_TIMEOUT + STALL_TIMEOUT
    result = faults.render_stall(server, 4)
    # not before its limit (a load can only delay it); the upper bound generous for loaded cores
    assert limit - 0.5 <= result["unready_after_s"] <= limit + 10, result
    assert result["health_while_stuck"] == 503 and "render worker 0" in result["health_says"], result
    assert (result["ok"], result["hung"]) == (4, 0), result
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
