"""Anthropic's request diagnostics: why the prompt cache could not reuse the prefix of an earlier request.

A Messages request that sends `diagnostics` has its prompt's fingerprint kept (in the state database, so
that any render worker finds it) under its message id: the model, a digest and token count of its tools, of
its system text and of each message, and a digest of what else shapes the prompt. A later request naming
that id as `diagnostics.previous_message_id` is compared with it, and its response's
`diagnostics.cache_miss_reason` says where the two first differ, in the order Anthropic's prompt is laid
out (tools, system, messages), with the tokens after that point that the previous request's prompt had (those
the cache would have given back); null where the new prompt only appends to the old one.
"""
from __future__ import annotations

import hashlib
import logging
import sqlite3
import time
from typing import Any

import msgspec

from sluice import state
from sluice.base.config import ServerConfig
from sluice.schemas.anthropic import CacheMiss, Diagnostics

log = logging.getLogger("sluice.render")
KEEP_S = 24 * 3600  # how long a fingerprint is kept to compare with
_MIGRATIONS = ["CREATE TABLE prompt_fingerprints (message_id TEXT PRIMARY KEY, created REAL NOT NULL, "
               "fingerprint BLOB NOT NULL); CREATE INDEX prompt_fingerprints_created ON prompt_fingerprints(created);"]


class Part(msgspec.Struct, array_like=True):
    digest: str
    tokens: int


class Fingerprint(msgspec.Struct, array_like=True):
    model: str
    tools: Part
    system: Part
    messages: list[Part]
    other: str  # a digest of the rest that shapes the prompt (thinking, tool_choice, output_config)

    @property
    def tokens(self) -> int:
        return self.tools.tokens + self.system.tokens + sum(m.tokens for m in self.messages)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Fingerprint)


def digest(value: Any) -> str:
    """A digest of a JSON-like value, its cache_control markers left out (they move from turn to turn and
    are no part of the prompt)."""
    return hashlib.sha256(msgspec.json.encode(_without_cache_control(value))).hexdigest()[:32]


def _without_cache_control(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_without_cache_control(v) for v in value]
    return value


def cache_miss(previous: Fingerprint | None, current: Fingerprint) -> Diagnostics | None:
    """Why `current` could not reuse `previous`'s prefix, as the SDK's CacheMissReason types say it (None: it
    could, only appending to it)."""
    if previous is None:
        return Diagnostics(CacheMiss("previous_message_not_found"))
    if previous.model != current.model:
        return _missed("model_changed", previous.tokens)
    if previous.tools.digest != current.tools.digest:
        return _missed("tools_changed", previous.tokens)
    if previous.system.digest != current.system.digest:
        return _missed("system_changed", previous.tokens - previous.tools.tokens)
    for k, (before, now) in enumerate(zip(previous.messages, current.messages)):
        if before.digest != now.digest:
            kept = previous.tools.tokens + previous.system.tokens + sum(m.tokens for m in previous.messages[:k])
            return _missed("messages_changed", previous.tokens - kept)
    if previous.other != current.other:
        return Diagnostics(CacheMiss("unavailable"))  # (the SDK's word for the other prompt-shaping fields)
    return None


def _missed(kind: str, tokens: int) -> Diagnostics:
    return Diagnostics(CacheMiss(kind, max(tokens, 0)))


class Fingerprints:
    """This process's fingerprints in the state database (opened on first use)."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self._conn: sqlite3.Connection | None = None

    def compare_and_keep(self, message_id: str, previous_id: str | None, current: Fingerprint) -> Diagnostics | None:
        """The diagnosis of `current` against `previous_id`'s (where one is named), after keeping `current`
        under `message_id`. A database that fails under it: 'unavailable' (the request is served as ever)."""
        try:
            conn = self._connection()
            now = time.time()
            with conn:
                conn.execute("INSERT OR REPLACE INTO prompt_fingerprints VALUES (?, ?, ?)",
                             (message_id, now, _encoder.encode(current)))
                conn.execute("DELETE FROM prompt_fingerprints WHERE created < ?", (now - KEEP_S,))
            if previous_id is None:
                return None
            row = conn.execute("SELECT fingerprint FROM prompt_fingerprints WHERE message_id = ?",
                               (previous_id,)).fetchone()
        except state.ERRORS as e:
            log.warning("diagnostics: the state database (--state-dir %s) could not be used: %s",
                        self.cfg.state_dir, e)
            return Diagnostics(CacheMiss("unavailable")) if previous_id is not None else None
        return cache_miss(_decoder.decode(row[0]) if row else None, current)

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            conn = state.connect(self.cfg)
            state.migrate(conn, "prompt_fingerprints", _MIGRATIONS)
            self._conn = conn
        return self._conn
