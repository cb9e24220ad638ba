"""What users submitted that must outlive the request and the process (Message Batches, stored responses):
an SQLite database under --state-dir, written by the process that owns the work, read by every ingress
worker. WAL mode: readers never wait for the writer, and a crash loses no committed row."""
from __future__ import annotations

import asyncio
import logging
import sqlite3
import tempfile
from pathlib import Path

from ipc.messages import Failure
from sluice import envs
from sluice.config import ServerConfig

log = logging.getLogger("sluice.state")
_BUSY_TIMEOUT_MS = 10_000  # several processes write: wait for the lock rather than fail
ERRORS = (sqlite3.Error, OSError)  # what the state database raises when it cannot be used
RETRY_S = 5.0  # how often a background loop tries a database that failed under it again


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


def unavailable(cfg: ServerConfig, error: BaseException) -> Failure:
    """A request's error when the state database fails under it (every route says it in its dialect)."""
    log.error("the state database under --state-dir %s failed: %s", cfg.state_dir, error)
    return Failure(500, f"the state database (--state-dir {cfg.state_dir}) could not be used: {error}",
                   "state_unavailable")


def problem(state_dir: str) -> str | None:
    """Why `state_dir` cannot hold the database (None: it can). Leaves nothing behind: a server that never
    stores anything makes no database."""
    path = Path(state_dir)
    try:
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir():
            return f"{existing} is not a directory"
        if existing != path:  # the directory would be made under `existing`
            Path(tempfile.mkdtemp(dir=existing)).rmdir()
            return None
        tempfile.TemporaryFile(dir=path).close()
        db = path / "sluice.sqlite3"
        if db.exists():
            with sqlite3.connect(f"file:{db}?mode=rw", uri=True) as conn:
                conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.Error as e:
        return f"its database {path / 'sluice.sqlite3'}: {e}"
    except OSError as e:
        return str(e)
    return None


def check_dir(cfg: ServerConfig, given: bool) -> None:
    """At startup: a state directory that cannot be used fails the server when it was given (--state-dir, a
    config file); one only defaulted to (the environment, the home directory) is a warning, and the routes
    that need it answer an error naming it."""
    if (why := problem(cfg.state_dir)) is None:
        return
    message = f"--state-dir {cfg.state_dir} cannot be used: {why}"
    if given:
        raise ValueError(message)
    log.warning("%s (batches and stored responses will fail; set --state-dir)", message)


class Outage:
    """A background loop's view of the database: says once when it fails under the loop (which waits and
    tries again: the work it holds is not lost, and a process restarted over and over would not help), and
    when it is back."""

    def __init__(self, cfg: ServerConfig, what: str) -> None:
        self.cfg = cfg
        self.what = what
        self.down = False

    async def failed(self, error: BaseException) -> None:
        if not self.down:
            log.error("%s: the state database under --state-dir %s failed (%s): trying again every %gs",
                      self.what, self.cfg.state_dir, error, RETRY_S)
        self.down = True
        await asyncio.sleep(RETRY_S)

    def ok(self) -> None:
        if self.down:
            log.info("%s: the state database is back", self.what)
        self.down = False
