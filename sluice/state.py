"""What users submitted that must outlive the request and the process (Message Batches, stored responses):
an SQLite database under --state-dir, written by the process that owns the work, read by every ingress
worker. WAL mode: readers never wait for the writer, and a crash loses no committed row."""
from __future__ import annotations

import sqlite3
from pathlib import Path

from sluice import envs
from sluice.config import ServerConfig

_BUSY_TIMEOUT_MS = 10_000  # several processes write: wait for the lock rather than fail


def database_path(cfg: ServerConfig) -> Path:
    return Path(cfg.state_dir or envs.state_dir()) / "sluice.sqlite3"


def connect(cfg: ServerConfig) -> sqlite3.Connection:
    """A connection of this process's own (autocommit off; use `with conn:` for a transaction)."""
    path = database_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    conn = sqlite3.connect(path, timeout=_BUSY_TIMEOUT_MS / 1000, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")  # (WAL: durable at each checkpoint; a commit survives a crash)
    conn.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
    conn.row_factory = sqlite3.Row
    return conn


def migrate(conn: sqlite3.Connection, component: str, steps: list[str]) -> None:
    """Brings `component`'s tables up to date: `steps` are its schema changes in order, each applied once."""
    with conn:
        conn.execute("CREATE TABLE IF NOT EXISTS schema_versions (component TEXT PRIMARY KEY, version INTEGER)")
        row = conn.execute("SELECT version FROM schema_versions WHERE component = ?", (component,)).fetchone()
        done = row[0] if row else 0
        for sql in steps[done:]:
            conn.executescript(sql)
        conn.execute("INSERT INTO schema_versions VALUES (?, ?) ON CONFLICT(component) DO UPDATE SET version = ?",
                     (component, len(steps), len(steps)))
