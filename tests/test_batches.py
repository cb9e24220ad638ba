"""Message Batches state (sluice.state.batches.BatchStore) and its runner, with a fake background owner."""
from __future__ import annotations

import asyncio
import json
import time
import tracemalloc

import pytest

from sluice.base.config import ServerConfig
from sluice.ipc.messages import Failure, Frame
from sluice.state import batches
from sluice.state.batches import BatchQueue, BatchStore
from sluice.state.database import Database, serve_queue

PARAMS = json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.fixture
def cfg(tmp_path) -> ServerConfig:
    return ServerConfig(model="m", served_model_names=["m"], state_dir=str(tmp_path), background_concurrency=4)


@pytest.fixture
def store(cfg) -> BatchStore:
    return BatchStore(cfg)


def lines(store: BatchStore, batch_id: str, page: int = 100) -> list[dict]:
    out, after = [], -1
    while got := store.results(batch_id, after, page):
        out += [json.loads(line) for _, line in got]
        after = got[-1][0]
    return out


class FakeOwner:
    """Answers each request with the next of `outcomes` (a message body, or a Failure)."""

    def __init__(self, cfg: ServerConfig, outcomes) -> None:
        self.cfg = cfg
        self.outcomes = outcomes
        self.calls = 0

    async def complete(self, endpoint, body, id_prefix):
        self.calls += 1
        await asyncio.sleep(0)
        outcome = next(self.outcomes)
        if isinstance(outcome, Failure):
            return "msg_x", Frame("msg_x", b"", True, outcome)
        return "msg_x", Frame("msg_x", outcome, True)


async def until(done, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the runner did not get there"
        await asyncio.sleep(0.05)


def runner(owner):
    """The background owner's batch task (with its own connection, as in the owner process)."""
    return serve_queue(owner.cfg, BatchQueue(owner, Database(owner.cfg, BatchStore)))


async def run_until(runner, done) -> None:
    task = asyncio.create_task(runner)
    try:
        await until(done)
    finally:
        task.cancel()


def test_a_batch_is_kept_listed_and_paged_newest_first(store):
    ids = [store.create([(f"c{i}", PARAMS)]).id for i in range(5)]
    first = store.page(2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more and first.first_id == ids[4]
    after = store.page(2, after_id=first.last_id)
    assert [b.id for b in after.data] == ids[::-1][2:4] and after.has_more
    before = store.page(2, before_id=after.first_id)
    assert [b.id for b in before.data] == ids[::-1][:2] and not before.has_more
    assert store.page(10, after_id=ids[0]).data == [] and store.page(1, after_id="msgbatch_nope") is None
    batch = store.get(ids[0])
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 1
    assert batch.results_url is None and batch.created_at.endswith("Z") and batch.ended_at is None


def test_the_runner_writes_each_outcome_and_ends_the_batch(cfg, store):
    batch = store.create([("ok", PARAMS), ("bad", PARAMS), ("elsewhere", PARAMS.replace(b'"m"', b'"other"'))])
    owner = FakeOwner(cfg, iter([b'{"id":"msg_x","type":"message"}', Failure(400, "no", param="messages")]))
    asyncio.run(run_until(runner(owner), lambda: store.get(batch.id).processing_status == "ended"))
    got = {line["custom_id"]: line["result"] for line in lines(store, batch.id)}
    assert got["ok"] == {"type": "succeeded", "message": {"id": "msg_x", "type": "message"}}
    assert got["bad"]["error"] == {"type": "error", "error": {"type": "invalid_request_error",
                                                               "message": "messages: no"}}
    assert got["elsewhere"]["type"] == "errored" and got["elsewhere"]["error"]["error"]["type"] == "not_found_error"
    ended = store.get(batch.id)
    assert ended.results_url == f"/v1/messages/batches/{batch.id}/results" and ended.ended_at is not None
    assert (ended.request_counts.succeeded, ended.request_counts.errored) == (1, 2) and owner.calls == 2


def test_work_the_server_dropped_runs_again(cfg, store):
    """A drain's 503 (or a dead engine, a dead worker) is no outcome: the request stays processing."""
    batch = store.create([("a", PARAMS)])
    owner = FakeOwner(cfg, iter([Failure(503, "draining", "shutting_down"), Failure(500, "gone", "worker_died"),
                                 b'{"id":"msg_x"}']))
    asyncio.run(run_until(runner(owner), lambda: store.get(batch.id).processing_status == "ended"))
    assert owner.calls == 3 and lines(store, batch.id)[0]["result"]["type"] == "succeeded"


def test_cancel_ends_what_is_not_running_and_keeps_what_finished(cfg, store):
    batch = store.create([(f"c{i}", PARAMS) for i in range(50)])
    gate = asyncio.Event()

    class Slow(FakeOwner):
        async def complete(self, endpoint, body, id_prefix):
            await gate.wait()
            return await super().complete(endpoint, body, id_prefix)

    owner = Slow(cfg, iter(lambda: b'{"id":"msg_x"}', None))

    async def scenario():
        task = asyncio.create_task(runner(owner))
        await asyncio.sleep(0.2)  # the runner took its first requests
        assert store.cancel(batch.id).processing_status == "canceling"
        await until(lambda: store.get(batch.id).request_counts.canceled > 0)  # the rest is canceled,
        assert store.get(batch.id).request_counts.processing == 2 * cfg.background_concurrency  # the running ones
        gate.set()
        await until(lambda: store.get(batch.id).processing_status == "ended")
        task.cancel()

    asyncio.run(scenario())
    counts = store.get(batch.id).request_counts
    assert counts.succeeded == 2 * cfg.background_concurrency and counts.canceled == 50 - counts.succeeded
    assert {line["result"]["type"] for line in lines(store, batch.id)} == {"succeeded", "canceled"}
    assert store.get(batch.id).cancel_initiated_at is not None


def test_expired_and_deleted(cfg, store, monkeypatch):
    monkeypatch.setattr(batches, "EXPIRY_S", -1.0)
    batch = store.create([("a", PARAMS)])
    assert store.delete(batch.id) == "in_progress"
    store.settle(set())
    assert store.get(batch.id).request_counts.expired == 1 and lines(store, batch.id)[0]["result"] == {
        "type": "expired"}
    assert store.delete(batch.id) == "deleted" and store.get(batch.id) is None and store.delete(batch.id) is None


def test_results_are_read_a_page_at_a_time(store):
    """10,000 results of 4 KB each: reading them all holds one page, not the batch."""
    batch = store.create((f"c{i}", PARAMS) for i in range(10_000))
    body = b'{"type":"succeeded","message":{"text":"%s"}}' % (b"x" * 4000)
    store.conn.execute("UPDATE batch_requests SET state = 'succeeded', result = ?", (body,))
    store.conn.commit()
    tracemalloc.start()
    try:
        after, n = -1, 0
        while page := store.results(batch.id, after, 512):
            after, n = page[-1][0], n + len(page)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == 10_000 and peak < 8 * 512 * 4096  # the results hold 40 MB in all
