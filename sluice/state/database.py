"""What users submitted that must outlive the request and the process (Message Batches, stored responses):
an SQLite database under --state-dir, written by the process that owns the work, read by every ingress
worker. WAL mode: readers never wait for the writer, and a crash loses no committed row."""
from __future__ import annotations

import asyncio
import functools
import logging
import sqlite3
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Generic, Hashable, Protocol, TypeVar

from sluice.base import envs
from sluice.base.config import ServerConfig
from sluice.ipc.messages import Failure

log = logging.getLogger("sluice.state.database")
_BUSY_TIMEOUT_MS = 10_000  # several processes write: wait for the lock rather than fail
ERRORS = (sqlite3.Error, OSError)  # what the state database raises when it cannot be used
RETRY_S = 5.0  # how often a background loop tries a database that failed under it again
POLL_S = 0.1  # how often a queue of background work looks for new work and cancels
# failures of the server, not of the request (a drain, a dead engine, a dead worker): no outcome, the work runs again
RETRY_CODES = frozenset({"shutting_down", "engine_dead", "worker_died"})
S = TypeVar("S")
T = TypeVar("T")
K = TypeVar("K", bound=Hashable)  # a piece of background work's key


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


class Database(Generic[S]):
    """This process's store of one kind (its SQL over a connection of its own), opened on first use (a server
    that never stores anything makes no database), its calls run one at a time on a thread of its own: an
    event loop never waits on SQLite's lock."""

    def __init__(self, cfg: ServerConfig, store: Callable[[ServerConfig], S]) -> None:
        self.cfg = cfg
        self._open = store
        self._store: S | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sluice-state")

    def exists(self) -> bool:
        return self._store is not None or database_path(self.cfg).exists()

    async def run(self, fn: Callable[..., T], *args) -> T:
        """`fn(store, *args)` on the database's thread (raises what the database raises: ERRORS)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._call, fn, args)

    async def answer(self, fn: Callable[..., T], *args) -> T | Failure:
        """`run`, for a request: a database that fails under it is a Failure, which every route answers in its
        dialect (never a plain-text 500)."""
        try:
            return await self.run(fn, *args)
        except ERRORS as e:
            return unavailable(self.cfg, e)

    def _call(self, fn: Callable[..., T], args: tuple) -> T:
        if self._store is None:
            self._store = self._open(self.cfg)
        return fn(self._store, *args)


_databases: dict[tuple[str, Callable], Database] = {}


def database(cfg: ServerConfig, store: Callable[[ServerConfig], S]) -> Database[S]:
    """This process's Database of a kind of store."""
    key = (cfg.state_dir, store)
    if key not in _databases:
        _databases[key] = Database(cfg, store)
    return _databases[key]


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


class Queue(Protocol[K]):
    """A kind of background work kept in the database (Message Batches, background responses), as
    `serve_queue` runs it: its store says what to run and what was cancelled, `run` runs one piece of work."""

    what: str  # (for the log)
    db: Database

    async def resume(self) -> None:
        """Once, before anything runs: what a restart cut short."""

    async def stopped(self, running: set[K]) -> set[K]:
        """Of the work running, what is no longer wanted (cancelled, deleted); and settles the rest."""
        ...

    async def pending(self, room: int, running: set[K]) -> list[tuple[K, bytes]]:
        """Up to `room` pieces of work to run next (none of `running`): (key, job)."""
        ...

    async def run(self, key: K, job: bytes) -> None: ...


async def serve_queue(cfg: ServerConfig, queue: Queue[K]) -> None:
    """Runs a queue's work, twice --background-concurrency started at a time (refilled in bulk, once half
    has finished: the background owner runs --background-concurrency of it at once, the rest waits its
    turn), and stops the work no longer wanted. A database that fails under it is waited out (Outage)."""
    while not queue.db.exists():  # (nothing was ever submitted: no database to make, wherever --state-dir
        await asyncio.sleep(1.0)  # points, so a server that cannot write it starts)
    outage = Outage(cfg, queue.what)
    window = 2 * cfg.background_concurrency
    running: dict[K, asyncio.Task] = {}
    resumed = False
    while True:
        try:
            if not resumed:
                await queue.resume()
                resumed = True
            for key in await queue.stopped(set(running)):
                running.pop(key).cancel()
            if len(running) <= window // 2:
                for key, job in await queue.pending(window - len(running), set(running)):
                    task = running[key] = asyncio.create_task(queue.run(key, job))
                    task.add_done_callback(functools.partial(_forget, queue.what, running, key))
            outage.ok()
        except ERRORS as e:
            await outage.failed(e)
            continue
        if running:
            await asyncio.wait(list(running.values()), timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.sleep(POLL_S)


def _forget(what: str, running: dict, key: Hashable, task: asyncio.Task) -> None:
    if running.get(key) is task:
        del running[key]
    if not task.cancelled() and task.exception() is not None:
        log.error("%s: %s failed", what, key, exc_info=task.exception())
