"""Stored and background responses (the Responses API): their state in the database under --state-dir, and
the background owner's task that runs the background ones.

Who writes what: an ingress worker writes a stored response it served itself, before the response's last
bytes leave (a chained request sent the moment the client has them must find it; and not the postproc,
whose loop serves every request and must never wait on SQLite's lock), and queues a background one. The
background owner runs what is queued and writes its events and outcome as they come (any ingress worker
follows them for a client: GET ?stream=true); a cancel or a delete is written by the worker that gets it.
Every ingress worker reads them all. The engine request of a response has the response's id.

After a restart a queued background response runs; one that was running fails (its stream cannot be taken
up again where it stopped).
"""
from __future__ import annotations

import contextlib
import logging
import sqlite3
from typing import Iterator, TypeVar

import msgspec

from sluice import state
from sluice.base.config import ServerConfig
from sluice.ipc.messages import Failure, Frame
from sluice.schemas.responses import (TERMINAL, ErrorEvent, InputItem, Response, ResponseError, ResponseEvent,
                                      ResponseHead, sse)

log = logging.getLogger("sluice.responses")
MAX_CHAIN = 10_000  # responses a previous_response_id chain may reach back through
_SCHEMA = ["""
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    background INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    previous_response_id TEXT,
    response BLOB NOT NULL,     -- the Response, JSON, as it stands
    input_items BLOB NOT NULL,  -- its own input items (JSON, with ids)
    job BLOB                    -- background, until done: the render job's body
);
CREATE INDEX IF NOT EXISTS responses_queued ON responses (created_at) WHERE status = 'queued';
CREATE TABLE IF NOT EXISTS response_events (  -- a background response's stream, for clients that follow it
    response_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    event BLOB NOT NULL,        -- SSE bytes
    PRIMARY KEY (response_id, seq)
) WITHOUT ROWID;
"""]  # (IF NOT EXISTS: the workers and the owner may open the database at once)
_items = msgspec.json.Decoder(list[InputItem])
_json = msgspec.json.Encoder()
_head = msgspec.json.Decoder(ResponseHead)
_response = msgspec.json.Decoder(Response)
T = TypeVar("T")


class NotFound(Exception):
    pass


class NotReady(Exception):
    """A response that is still queued or in progress."""


class _Output(msgspec.Struct):
    output: list[InputItem] = []  # (output items read back as the input items they become)


_outputs = msgspec.json.Decoder(_Output)


class Store:
    """The responses' tables, through one connection of this process's own."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.conn = state.connect(cfg)
        state.migrate(self.conn, "responses", _SCHEMA)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A transaction that holds the write lock from its first read, so what it reads stays true until
        it commits (several processes write the same responses)."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.conn.rollback()
            raise
        self.conn.commit()

    # ---- stored responses ------------------------------------------------------

    def save(self, response: bytes, input_items: bytes, job: bytes | None = None, first_event: bytes | None = None
             ) -> None:
        """A response as served (or queued, with the job that runs it and its stream's first event)."""
        h = _head.decode(response)
        with self._writing():
            self.conn.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                              (h.id, h.status, h.background, h.created_at, h.previous_response_id, response,
                               input_items, job))
            if first_event is not None:
                self.conn.execute("INSERT INTO response_events VALUES (?, 0, ?)", (h.id, first_event))

    def get(self, rid: str) -> sqlite3.Row | None:
        return self.conn.execute("SELECT * FROM responses WHERE id = ?", (rid,)).fetchone()

    def check(self) -> None:
        """Raises when the database cannot be read: a response to be stored asks before it is generated."""
        self.conn.execute("SELECT 1 FROM responses LIMIT 1").fetchall()

    def conversation(self, rid: str) -> list[InputItem]:
        """The items of the conversation that ends with response `rid`, oldest first: each response's input
        items and output. It begins at the oldest response still kept (one deleted cuts the chain there), and
        reaches back through at most MAX_CHAIN responses (older ones are left out). Rows whose
        previous_response_id leads back to one already walked (a loop: the state was edited, or is damaged)
        end the walk there, as a deleted one does, with a warning: each response comes in once."""
        turns: list[list[InputItem]] = []
        seen: set[str] = set()
        at: str | None = rid
        while at is not None and len(turns) < MAX_CHAIN:
            if at in seen:
                log.warning("the chain of stored responses from %s loops back to %s: it begins after it", rid, at)
                break
            seen.add(at)
            row = self.get(at)
            if row is None:
                if at == rid:
                    raise NotFound(rid)
                break
            if row["status"] not in TERMINAL:
                raise NotReady(at)
            turns.append(_items.decode(row["input_items"]) + _outputs.decode(row["response"]).output)
            at = row["previous_response_id"]
        return [item for turn in reversed(turns) for item in turn]

    def delete(self, rid: str) -> bool:
        with self._writing():
            self.conn.execute("DELETE FROM response_events WHERE response_id = ?", (rid,))
            return self.conn.execute("DELETE FROM responses WHERE id = ?", (rid,)).rowcount > 0

    # ---- background responses ------------------------------------------------------

    def cancel(self, rid: str) -> sqlite3.Row | None:
        """Cancels a queued or running background response (its stream ends with an error event saying so);
        the row as it then stands. A finished one stays as it is."""
        with self._writing():
            row = self.get(rid)
            if row is None or not row["background"] or row["status"] in TERMINAL:
                return row
            response = _response.decode(row["response"])
            response.status = "cancelled"
            self._end(rid, response, ErrorEvent(sequence_number=0, code="response_cancelled",
                                                message="the response was cancelled"))
        return self.get(rid)

    def fail(self, rid: str, failure: Failure) -> None:
        """Ends a background response that could not be run (unless it ended otherwise meanwhile)."""
        with self._writing():
            row = self.get(rid)
            if row is None or row["status"] in TERMINAL:
                return
            response = _response.decode(row["response"])
            response.status, response.error = "failed", ResponseError(failure.code or "server_error", failure.message)
            self._end(rid, response, ErrorEvent(sequence_number=0, code=failure.code, message=failure.message,
                                                param=failure.param), last=True)

    def retry(self, rid: str, failure: Failure) -> None:
        """A background response the server dropped (state.RETRY_CODES): queued again while none of its
        stream went out (but response.created, stored when it was queued), else failed (a stream cannot be
        taken up again)."""
        with self._writing():
            begun = self.conn.execute("SELECT 1 FROM response_events WHERE response_id = ? AND seq > 0 LIMIT 1",
                                      (rid,)).fetchone()
            if begun is None:
                self.conn.execute("UPDATE responses SET status = 'queued' WHERE id = ? AND status = 'in_progress'",
                                  (rid,))
                return
        self.fail(rid, failure)

    def _end(self, rid: str, response: Response, error: ErrorEvent, last: bool = False) -> None:
        """(In a transaction.) The response as it ends, its stream closed by `error` (and response.failed)."""
        seq = self.conn.execute("SELECT MAX(seq) FROM response_events WHERE response_id = ?", (rid,)).fetchone()[0]
        error.sequence_number = (-1 if seq is None else seq) + 1
        events = [sse(error)]
        if last:
            events.append(sse(ResponseEvent(type="response.failed", sequence_number=error.sequence_number + 1,
                                            response=response)))
        self.conn.executemany("INSERT INTO response_events VALUES (?, ?, ?)",
                              [(rid, error.sequence_number + i, e) for i, e in enumerate(events)])
        self.conn.execute("UPDATE responses SET status = ?, response = ?, job = NULL WHERE id = ?",
                          (response.status, _json.encode(response), rid))

    def queued(self, limit: int, running: list[str]) -> list[tuple[str, bytes]]:
        """The oldest queued background responses not already `running`: (id, render job body)."""
        marks = ",".join("?" * len(running))
        return [(r["id"], r["job"]) for r in self.conn.execute(
            f"SELECT id, job FROM responses WHERE status = 'queued' AND id NOT IN ({marks}) ORDER BY created_at "
            "LIMIT ?", (*running, limit))]

    def settled(self, rids: list[str]) -> set[str]:
        """Those of `rids` no longer queued or running (cancelled, deleted)."""
        marks = ",".join("?" * len(rids))
        live = {r[0] for r in self.conn.execute(
            f"SELECT id FROM responses WHERE id IN ({marks}) AND status IN ('queued', 'in_progress')", rids)}
        return set(rids) - live

    def append(self, rid: str, frame: Frame) -> bool:
        """A frame of a running background response: its events, numbered up to the frame's sequence, and its
        status: in progress, or the finished response its last frame carries (Frame.stored). False when the
        response is no longer running (cancelled, deleted): nobody wants the rest."""
        events = frame.events()
        first = frame.sequence - len(events)
        with self._writing():
            row = self.conn.execute("SELECT status FROM responses WHERE id = ?", (rid,)).fetchone()
            if row is None or row[0] in TERMINAL:
                return False
            self.conn.executemany("INSERT INTO response_events VALUES (?, ?, ?)",
                                  [(rid, first + i, e) for i, e in enumerate(events)])
            if frame.done and frame.stored:
                status = _head.decode(frame.stored).status
                self.conn.execute("UPDATE responses SET status = ?, response = ?, job = NULL WHERE id = ?",
                                  (status, frame.stored, rid))
            elif row[0] == "queued":
                self.conn.execute("UPDATE responses SET status = 'in_progress', response = CAST(json_set(CAST("
                                  "response AS TEXT), '$.status', 'in_progress') AS BLOB) WHERE id = ?", (rid,))
        return True

    def interrupted(self) -> list[str]:
        """Fails the background responses a restart cut short (their stream cannot be taken up again); their
        ids. Queued ones run again."""
        rids = [r[0] for r in self.conn.execute("SELECT id FROM responses WHERE status = 'in_progress'")]
        for rid in rids:
            self.fail(rid, Failure(500, "the server restarted while this response was being generated",
                                   "server_restarted"))
        return rids

    def events_after(self, rid: str, after: int) -> tuple[list[tuple[int, bytes]], bool] | None:
        """A background response's events after sequence number `after`, and whether they are its last
        (None: no such response)."""
        row = self.conn.execute("SELECT status FROM responses WHERE id = ?", (rid,)).fetchone()
        if row is None:
            return None
        events = self.conn.execute("SELECT seq, event FROM response_events WHERE response_id = ? AND seq > ? "
                                   "ORDER BY seq", (rid, after)).fetchall()
        return [(s, e) for s, e in events], row[0] in TERMINAL  # (status first: a final status has all its events)


class ResponseQueue:
    """The queued background responses as background work (state.serve_queue): each one's events and outcome
    written as they come; those cancelled or deleted stopped."""

    what = "background responses"

    def __init__(self, owner, db: state.Database[Store]) -> None:
        self.owner = owner
        self.db = db

    async def resume(self) -> None:
        for rid in await self.db.run(Store.interrupted):
            self.owner.pipeline.abort(rid)  # a restarted owner's: the engine may still run them

    async def stopped(self, running: set[str]) -> set[str]:
        return await self.db.run(Store.settled, list(running)) if running else set()

    async def pending(self, room: int, running: set[str]) -> list[tuple[str, bytes]]:
        return await self.db.run(Store.queued, room, list(running))

    async def run(self, rid: str, job: bytes) -> None:
        db = self.db
        try:
            async with contextlib.aclosing(self.owner.frames("responses", job, rid)) as frames:
                async for frame in frames:
                    if frame.error is not None:
                        await db.run(Store.retry if frame.error.code in state.RETRY_CODES else Store.fail, rid,
                                     frame.error)
                        return
                    if not await db.run(Store.append, rid, frame):
                        return  # cancelled or deleted: closing the frames drops it from the engine
        except Exception:  # (not taken up again: it would fail the same way, over and over)
            log.exception("background response %s failed", rid)
            with contextlib.suppress(*state.ERRORS):  # (else it stays in progress: the next start fails it)
                await db.run(Store.fail, rid, Failure(500, "internal error while running this response",
                                                      "internal_error"))


async def run(owner) -> None:
    """The background owner's task: runs the queued background responses."""
    await state.serve_queue(owner.cfg, ResponseQueue(owner, state.database(owner.cfg, Store)))
