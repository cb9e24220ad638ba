"""Message Batches end to end with the official SDK: a real server, its background owner and its state
database; 10,000 requests behind interactive traffic, errors as results, cancel, delete, and a restart."""
from __future__ import annotations

import json
import sqlite3
import time

import anthropic
import httpx
import pytest

from bench.server import Server
from tests.e2e.test_anthropic import recording

MODEL = "builtin:tiny-chat"


def request(i: int, **params) -> dict:
    return {"custom_id": f"r{i}", "params": {"model": MODEL, "max_tokens": 16,
                                             "messages": [{"role": "user", "content": f"Hello {i}"}], **params}}


def serve(tmp_path_factory, tiny_chat_dir, state, *args: str) -> Server:
    return Server("--runner", "replay", "--replay-file", recording(tmp_path_factory, tiny_chat_dir, "Hi there."),
                  "--state-dir", str(state), *args)


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    return tmp_path_factory.mktemp("state")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_chat_dir, state):
    """2 ms a step, so that a batch of 2,000 is still running when the restart test, the last, stops it."""
    s = serve(tmp_path_factory, tiny_chat_dir, state, "--replay-step-ms", "2")
    yield s
    assert s.stop() == 0, s.output()


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)


def ended(c: anthropic.Anthropic, batch_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while (batch := c.messages.batches.retrieve(batch_id)).processing_status != "ended":
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


def test_10000_requests_run_behind_interactive_ones_and_their_results_stream(server):
    c = client(server)
    batch = c.messages.batches.create(requests=[request(i) for i in range(10_000)])
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 10_000
    for _ in range(5):  # interactive requests while the batch runs: each answered before the batch has ended
        assert c.messages.create(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Hi"}]).content
        assert c.messages.batches.retrieve(batch.id).request_counts.processing > 0  # (not queued behind it)
    batch = ended(c, batch.id)
    assert batch.request_counts.succeeded == 10_000 and batch.results_url.endswith(f"{batch.id}/results")
    with httpx.stream("GET", server.url + batch.results_url, timeout=60) as r:
        ids = [json.loads(line)["custom_id"] for line in r.iter_lines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(10_000))
    first = next(iter(c.messages.batches.results(batch.id)))
    assert first.result.type == "succeeded" and first.result.message.content[0].text == "Hi there."


def test_errors_are_results_and_the_batch_lifecycle(server):
    c = client(server)
    batch = c.beta.messages.batches.create(requests=[
        request(0), request(1, model="claude-nope"),
        request(2, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])])
    results = {r.custom_id: r.result for r in c.messages.batches.results(ended(c, batch.id).id)}
    assert results["r0"].type == "succeeded" and results["r0"].message.stop_reason == "end_turn"
    assert results["r1"].error.error.type == "not_found_error" and "claude-nope" in results["r1"].error.error.message
    assert results["r2"].error.error.type == "invalid_request_error" and "image" in results["r2"].error.error.message
    page = c.messages.batches.list(limit=1)
    assert [b.id for b in page.data] == [batch.id] and page.has_more
    assert c.messages.batches.list(limit=1, after_id=batch.id).data[0].id != batch.id
    assert c.messages.batches.delete(batch.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        c.messages.batches.retrieve(batch.id)


@pytest.mark.parametrize("requests, param", [
    ([request(0), request(0)], "requests[1].custom_id"),
    ([request(0), request(1, max_tokens="x")], "requests[1].params.max_tokens"),
    ([request(0, stream=True)], "requests[0].params.stream"),
    ([{"custom_id": "bad id!", "params": request(0)["params"]}], "custom_id"),
    ([], "requests"),
])
def test_a_batch_that_cannot_run_is_refused_whole(server, requests, param):
    r = httpx.post(server.url + "/v1/messages/batches", json={"requests": requests}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert param in r.json()["error"]["message"]


def test_cancel_keeps_what_finished_and_cancels_the_rest(server):
    c = client(server)
    batch = c.messages.batches.create(requests=[request(i) for i in range(3000)])
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.batches.delete(batch.id)
    assert "cancel it first" in e.value.message
    assert c.messages.batches.cancel(batch.id).processing_status in ("canceling", "ended")
    batch = ended(c, batch.id)
    counts = batch.request_counts
    assert counts.canceled > 0 and counts.succeeded + counts.canceled == 3000 and batch.cancel_initiated_at
    kinds = {r.result.type for r in c.messages.batches.results(batch.id)}
    assert "canceled" in kinds and kinds <= {"canceled", "succeeded"}


def test_a_batch_goes_on_across_a_restart(tmp_path_factory, tiny_chat_dir, server, state):
    """Last: it stops the module's server and starts another on its state directory."""
    c = client(server)
    batch = c.messages.batches.create(requests=[request(i) for i in range(2000)])
    while c.messages.batches.retrieve(batch.id).request_counts.succeeded < 100:
        time.sleep(0.05)
    assert server.stop() == 0, server.output()
    with sqlite3.connect(state / "sluice.sqlite3") as db:
        left = dict(db.execute("SELECT r.state, count(*) FROM batch_requests r JOIN message_batches b "
                               "ON r.batch = b.seq WHERE b.id = ? GROUP BY r.state", (batch.id,)).fetchall())
    assert left.get("processing", 0) > 0 and left["succeeded"] >= 100  # stopped halfway
    second = serve(tmp_path_factory, tiny_chat_dir, state)
    try:
        c = client(second)
        assert ended(c, batch.id).request_counts.succeeded == 2000
        ids = [r.custom_id for r in c.messages.batches.results(batch.id)]
        assert sorted(ids) == sorted(f"r{i}" for i in range(2000))
    finally:
        assert second.stop() == 0, second.output()
