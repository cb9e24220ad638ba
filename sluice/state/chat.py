"""Stored chat completions (OpenAI's `store: true`): the completion as answered, its request's messages and
its metadata, in the state database under --state-dir. The ingress worker that served a completion writes
it before the response's last bytes leave; every worker reads, updates and deletes them."""
from __future__ import annotations

import sqlite3

import msgspec

from sluice import state
from sluice.base.config import ServerConfig

_SCHEMA = ["""
CREATE TABLE IF NOT EXISTS chat_completions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- the order lists go by
    id TEXT NOT NULL UNIQUE,
    model TEXT NOT NULL,
    metadata BLOB NOT NULL,    -- JSON object
    completion BLOB NOT NULL,  -- the ChatCompletion as answered (JSON)
    messages BLOB NOT NULL     -- the request's messages as .../messages lists them (JSON, with ids)
);
"""]
_json = msgspec.json.Encoder()


class ChatStore:
    """The stored chat completions' table, through one connection of this process's (state.Database)."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.conn = state.connect(cfg)
        state.migrate(self.conn, "chat_completions", _SCHEMA)

    def check(self) -> None:
        """Raises when the database cannot be used: a completion to be stored asks before it is generated."""
        self.conn.execute("SELECT 1 FROM chat_completions LIMIT 1").fetchall()

    def save(self, cid: str, model: str, metadata: bytes, completion: bytes, messages: bytes) -> None:
        with self.conn:
            self.conn.execute("INSERT INTO chat_completions (id, model, metadata, completion, messages) "
                              "VALUES (?, ?, ?, ?, ?)", (cid, model, metadata, completion, messages))

    def get(self, cid: str) -> sqlite3.Row | None:
        return self.conn.execute("SELECT * FROM chat_completions WHERE id = ?", (cid,)).fetchone()

    def update(self, cid: str, metadata: bytes) -> sqlite3.Row | None:
        with self.conn:
            self.conn.execute("UPDATE chat_completions SET metadata = ? WHERE id = ?", (metadata, cid))
        return self.get(cid)

    def delete(self, cid: str) -> bool:
        with self.conn:
            return self.conn.execute("DELETE FROM chat_completions WHERE id = ?", (cid,)).rowcount > 0

    def page(self, limit: int, descending: bool, after: str | None, model: str | None,
             metadata: dict[str, str]) -> tuple[list[sqlite3.Row], bool] | None:
        """Up to `limit` completions in creation order (or its reverse) past the one `after` names, of `model`
        and with every `metadata` pair where given; and whether more follow. None: `after` names none."""
        where, args = [], []
        if after is not None:
            row = self.conn.execute("SELECT seq FROM chat_completions WHERE id = ?", (after,)).fetchone()
            if row is None:
                return None
            where.append("seq < ?" if descending else "seq > ?")
            args.append(row[0])
        if model is not None:
            where.append("model = ?")
            args.append(model)
        for key, value in metadata.items():
            where.append("EXISTS (SELECT 1 FROM json_each(metadata) WHERE key = ? AND value = ?)")
            args += [key, value]
        sql = (f"SELECT * FROM chat_completions {'WHERE ' + ' AND '.join(where) if where else ''} "
               f"ORDER BY seq {'DESC' if descending else 'ASC'} LIMIT ?")
        rows = self.conn.execute(sql, (*args, limit + 1)).fetchall()
        return rows[:limit], len(rows) > limit
