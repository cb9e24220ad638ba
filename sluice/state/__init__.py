"""The state under --state-dir: one SQLite database wrapper and one background queue runner (database.py) under
the stores, which keep only their SQL: batches.py (Anthropic Message Batches), responses.py (stored and background
responses), chat.py (stored chat completions). `from sluice import state` gives the wrapper's API."""
from sluice.state.database import (ERRORS, POLL_S, RETRY_CODES, RETRY_S, Database, Outage, Queue, check_dir, connect,
                                   database, database_path, migrate, problem, serve_queue, unavailable)

__all__ = ["ERRORS", "POLL_S", "RETRY_CODES", "RETRY_S", "Database", "Outage", "Queue", "check_dir", "connect",
           "database", "database_path", "migrate", "problem", "serve_queue", "unavailable"]
