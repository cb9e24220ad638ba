"""Anthropic Message Batches: their state (tables in the state database, sluice.state.database) and the background task
that runs them (sluice.app.background).

Ingress workers create, cancel, delete and read batches; the background owner alone writes each request's
outcome. A request is `processing` until then, so after a restart whatever is still processing runs again
(the work a drain cut off is not an outcome). Results stay in the database and are read a page at a time.
"""
from __future__ import annotations

import logging
import sqlite3
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Iterable

import msgspec

from sluice.base.config import ServerConfig
from sluice.ipc.messages import Failure
from sluice.schemas.anthropic import BatchList, MessageBatch, RequestCounts, error_response
from sluice.state.database import RETRY_CODES, Database, connect, database, migrate, serve_queue

log = logging.getLogger("sluice.state.batches")
EXPIRY_S = 24 * 3600  # as Anthropic: what has not run a day after the batch was made expires
CANCELED, EXPIRED = b'{"type":"canceled"}', b'{"type":"expired"}'

SCHEMA = ["""
CREATE TABLE IF NOT EXISTS message_batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- creation order: lists and the runner go by it
    id TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL,  -- in_progress, canceling, ended
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    ended_at REAL,
    cancel_initiated_at REAL
);
CREATE TABLE IF NOT EXISTS batch_requests (
    batch INTEGER NOT NULL,  -- message_batches.seq
    idx INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    params BLOB NOT NULL,  -- the request's JSON, as sent
    state TEXT NOT NULL DEFAULT 'processing',  -- processing, succeeded, errored, canceled, expired
    result BLOB,  -- the JSON of its result line's `result`
    PRIMARY KEY (batch, idx)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS batch_requests_by_state ON batch_requests (batch, state);
"""]

Key = tuple[int, int]  # (batch seq, request index)


def _time(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def errored(status: int, message: str, param: str | None = None) -> bytes:
    return msgspec.json.encode({"type": "errored", "error": error_response(status, message, param)})


class BatchStore:
    """The batch tables, through one connection of this process's (its calls one at a time: state.Database)."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.conn = connect(cfg)
        migrate(self.conn, "batches", SCHEMA)

    # ---- the ingress's -------------------------------------------------------------

    def create(self, requests: Iterable[tuple[str, bytes]]) -> MessageBatch:
        """A new batch of (custom_id, params JSON) requests."""
        batch_id, now = "msgbatch_" + uuid.uuid4().hex, time.time()
        with self.conn:
            seq = self.conn.execute("INSERT INTO message_batches (id, status, created_at, expires_at) "
                                    "VALUES (?, 'in_progress', ?, ?)", (batch_id, now, now + EXPIRY_S)).lastrowid
            self.conn.executemany("INSERT INTO batch_requests (batch, idx, custom_id, params) VALUES (?, ?, ?, ?)",
                                  ((seq, i, cid, params) for i, (cid, params) in enumerate(requests)))
        batch = self.get(batch_id)
        assert batch is not None
        return batch

    def get(self, batch_id: str) -> MessageBatch | None:
        row = self.conn.execute("SELECT * FROM message_batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else self._batch(row)

    def page(self, limit: int, before_id: str | None = None, after_id: str | None = None) -> BatchList | None:
        """Newest first; a page after (older than) or before (newer than) a batch. None: no such batch."""
        where, order, args = "", "DESC", [limit + 1]
        if before_id or after_id:
            cursor = self.conn.execute("SELECT seq FROM message_batches WHERE id = ?",
                                       (before_id or after_id,)).fetchone()
            if cursor is None:
                return None
            where, order = ("WHERE seq > ?", "ASC") if before_id else ("WHERE seq < ?", "DESC")
            args.insert(0, cursor[0])
        rows = self.conn.execute(f"SELECT * FROM message_batches {where} ORDER BY seq {order} LIMIT ?",
                                 args).fetchall()
        page = rows[:limit] if order == "DESC" else rows[:limit][::-1]
        data = [self._batch(row) for row in page]
        return BatchList(data, len(rows) > limit, data[0].id if data else None, data[-1].id if data else None)

    def cancel(self, batch_id: str) -> MessageBatch | None:
        with self.conn:
            self.conn.execute("UPDATE message_batches SET status = 'canceling', cancel_initiated_at = ? "
                              "WHERE id = ? AND status = 'in_progress'", (time.time(), batch_id))
        return self.get(batch_id)

    def delete(self, batch_id: str) -> str | None:
        """Deletes an ended batch; else its status (None: no such batch)."""
        with self.conn:
            row = self.conn.execute("SELECT seq, status FROM message_batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or row["status"] != "ended":
                return None if row is None else row["status"]
            self.conn.execute("DELETE FROM batch_requests WHERE batch = ?", (row["seq"],))
            self.conn.execute("DELETE FROM message_batches WHERE seq = ?", (row["seq"],))
            return "deleted"

    def results(self, batch_id: str, after: int, limit: int) -> list[tuple[int, bytes]]:
        """Result lines (JSONL, each with its newline) of requests past index `after`, in order, with their index."""
        rows = self.conn.execute(
            "SELECT r.idx, r.custom_id, r.result FROM batch_requests r JOIN message_batches b ON r.batch = b.seq "
            "WHERE b.id = ? AND r.idx > ? ORDER BY r.idx LIMIT ?", (batch_id, after, limit)).fetchall()
        return [(idx, b'{"custom_id":%s,"result":%s}\n' % (msgspec.json.encode(cid), result))
                for idx, cid, result in rows]

    def _batch(self, row: sqlite3.Row) -> MessageBatch:
        counts = dict(self.conn.execute("SELECT state, count(*) FROM batch_requests WHERE batch = ? GROUP BY state",
                                        (row["seq"],)).fetchall())
        ended = row["status"] == "ended"
        return MessageBatch(id=row["id"], processing_status=row["status"], request_counts=RequestCounts(**counts),
                            ended_at=_time(row["ended_at"]), created_at=_time(row["created_at"]) or "",
                            expires_at=_time(row["expires_at"]) or "",
                            cancel_initiated_at=_time(row["cancel_initiated_at"]),
                            results_url=f"/v1/messages/batches/{row['id']}/results" if ended else None)

    # ---- the runner's --------------------------------------------------------------

    def pending(self, limit: int, skip: set[Key]) -> list[tuple[Key, bytes]]:
        """Requests to run next (of batches in progress, oldest first), but those in `skip` (running)."""
        rows = self.conn.execute(
            "SELECT r.batch, r.idx, r.params FROM batch_requests r JOIN message_batches b ON r.batch = b.seq "
            "WHERE b.status = 'in_progress' AND r.state = 'processing' ORDER BY r.batch, r.idx LIMIT ?",
            (limit + len(skip),)).fetchall()
        return [((b, i), params) for b, i, params in rows if (b, i) not in skip][:limit]

    def finish(self, key: Key, state: str, result: bytes) -> None:
        with self.conn:
            self.conn.execute("UPDATE batch_requests SET state = ?, result = ? "
                              "WHERE batch = ? AND idx = ? AND state = 'processing'", (state, result, *key))

    def settle(self, running: set[Key]) -> None:
        """Cancels what is not running of batches being canceled, expires what has not run of batches past their
        time, and ends the batches with nothing left to run."""
        now = time.time()
        with self.conn:
            for seq, status, expires_at in self.conn.execute(
                    "SELECT seq, status, expires_at FROM message_batches WHERE status != 'ended'").fetchall():
                if status == "canceling":
                    self._close_pending(seq, "canceled", CANCELED, running)
                elif expires_at <= now:
                    self._close_pending(seq, "expired", EXPIRED, running)
                left = self.conn.execute("SELECT 1 FROM batch_requests WHERE batch = ? AND state = 'processing' "
                                         "LIMIT 1", (seq,)).fetchone()
                if left is None:
                    self.conn.execute("UPDATE message_batches SET status = 'ended', ended_at = ? WHERE seq = ?",
                                      (now, seq))

    def _close_pending(self, seq: int, state: str, result: bytes, running: set[Key]) -> None:
        busy = [i for b, i in running if b == seq]
        self.conn.execute(f"UPDATE batch_requests SET state = ?, result = ? WHERE batch = ? AND state = 'processing' "
                          f"AND idx NOT IN ({','.join('?' * len(busy))})", (state, result, seq, *busy))


class _Model(msgspec.Struct):
    model: str


_model = msgspec.json.Decoder(_Model)


class BatchQueue:
    """The batches' requests as background work (state.serve_queue), each outcome written as it comes."""

    what = "message batches"

    def __init__(self, owner: Any, db: Database[BatchStore]) -> None:
        self.owner = owner
        self.db = db
        self.names = set(owner.cfg.served_model_names)

    async def resume(self) -> None:
        pass  # (what a restart cut short is still processing: it runs again)

    async def stopped(self, running: set[Key]) -> set[Key]:
        await self.db.run(BatchStore.settle, running)
        return set()  # (a cancelled batch's running requests finish)

    async def pending(self, room: int, running: set[Key]) -> list[tuple[Key, bytes]]:
        return await self.db.run(BatchStore.pending, room, running)

    async def run(self, key: Key, job: bytes) -> None:
        model = _model.decode(job).model
        if model not in self.names:
            outcome = ("errored", errored(404, f"The model {model!r} does not exist; this server serves "
                                               f"{sorted(self.names)}"))
        else:
            _, frame = await self.owner.complete("messages", job, "msg_")
            if frame.error is not None and frame.error.code in RETRY_CODES:
                return  # still processing: it runs again (after the restart, if the server is going down)
            outcome = _outcome(frame.data, frame.error)
        await self.db.run(BatchStore.finish, key, *outcome)


def _outcome(data: bytes, error: Failure | None) -> tuple[str, bytes]:
    if error is not None:
        return "errored", errored(error.status, error.message, error.param)
    return "succeeded", b'{"type":"succeeded","message":%s}' % data


async def run(owner: Any) -> None:
    """The background task: runs what the database says is left, then what comes."""
    await serve_queue(owner.cfg, BatchQueue(owner, database(owner.cfg, BatchStore)))
